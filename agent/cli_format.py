"""``swimctl``'s text output and its member filters. Pure: results in, strings out.

Text is for people; ``--json`` (agent/cli_client.py) prints the control API's result
unchanged for scripts (schema in agent/control.py). Rules for the text:

- Tables: a header row, columns two spaces apart, numbers right-aligned, no trailing blanks.
- ``info``: titled sections of ``label  value`` rows; counts right-aligned with thousands
  separators, durations (``*_ms``) and byte counts (``bytes*``) in human units; a counter
  map (drops by reason) is its total with one indented row per key. Fields this client
  does not know (a newer agent) are still shown, in a last section, never dropped.
- Member filters follow ``serf members`` (hashicorp/serf, cmd/serf/command/agent/ipc.go
  ``filterMembers``): ``--name``, ``--status`` and each ``--tag KEY=REGEX`` must match the
  whole value (serf wraps them in ``^...$``; here ``re.fullmatch``, which also anchors an
  alternation such as ``a|b`` as a whole, as serf's help describes); a member without the
  tag is matched as the empty string (so ``KEY=.*`` matches every member, ``KEY=.+`` only
  those with the tag); all filters must match. Python's ``re`` syntax, not Go's RE2
  (the two agree on the usual classes, ranges and alternations). The filters run here, in
  the client: a regular expression is never sent to the agent (Python's ``re`` can take
  exponential time on a hostile pattern; the daemon must not).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agent.control import ROLE_TRAINING

STATUSES = ("alive", "suspect", "dead", "left")


# --- units ------------------------------------------------------------------------------


def count(n: int) -> str:
    return f"{n:,}"


def duration_ms(ms: int | float) -> str:
    """``850 ms``, ``12.3 s``, ``4m 05s``, ``2h 03m``, ``3d 04h``."""
    if ms < 1000:
        return f"{ms:.0f} ms"
    s = ms / 1000
    if s < 60:
        return f"{s:.1f} s"
    whole = int(s)
    if whole < 3600:
        return f"{whole // 60}m {whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h {whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d {whole % 86400 // 3600:02d}h"


def size_bytes(n: int) -> str:
    """``512 B``, ``12.3 KiB``, ``4.5 MiB``, ... (binary units)."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            break
    return f"{value:.1f} {unit}"


def ranges(spans: Iterable[tuple[int, int]]) -> str:
    """``0-7`` for ranks 0..7, ``3`` for one."""
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


# --- tables and sections ----------------------------------------------------------------


def table(rows: Sequence[Sequence[str]], right: Iterable[int] = ()) -> str:
    """Columns two spaces apart; the columns in ``right`` right-aligned (numbers)."""
    right = set(right)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(
            cell.rjust(w) if i in right else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in rows
    )


@dataclass(frozen=True, slots=True)
class Row:
    label: str
    value: str
    number: bool = False
    """Right-aligned within its section."""


def sections(blocks: Sequence[tuple[str, Sequence[Row]]]) -> str:
    """Titled blocks of ``label  value`` rows, labels in one column across all blocks."""
    shown = [(title, rows) for title, rows in blocks if rows]
    if not shown:
        return ""
    label_w = max(len(r.label) for _, rows in shown for r in rows)
    out: list[str] = []
    for title, rows in shown:
        number_w = max((len(r.value) for r in rows if r.number), default=0)
        out.append(title)
        for r in rows:
            value = r.value.rjust(number_w) if r.number else r.value
            out.append(f"  {r.label.ljust(label_w)}  {value}".rstrip())
        out.append("")
    return "\n".join(out[:-1])


def value_rows(key: str, value: Any, label: str | None = None) -> list[Row]:
    """One field as rows: units by the key's name, a counter map as its total and keys."""
    label = label or key.replace("_", " ")
    if value is None or isinstance(value, bool):
        return [Row(label, "-" if value is None else "yes" if value else "no")]
    if isinstance(value, int | float):
        if key.endswith("_ms"):
            return [Row(label, duration_ms(value), True)]
        if key.startswith("bytes") or key.endswith("_bytes"):
            return [Row(label, size_bytes(int(value)), True)]
        return [Row(label, count(value) if isinstance(value, int) else f"{value:,.3f}", True)]
    if isinstance(value, Mapping) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value.values()
    ):
        rows = [Row(label, count(sum(value.values())), True)]
        return rows + [Row(f"  {k}", count(v), True) for k, v in sorted(value.items())]
    if isinstance(value, Mapping | list):
        return [Row(label, ", ".join(f"{k}={v}" for k, v in _pairs(value)) or "-")]
    return [Row(label, str(value))]


def _pairs(value: Mapping[str, Any] | list[Any]) -> list[tuple[Any, Any]]:
    return sorted(value.items()) if isinstance(value, Mapping) else list(enumerate(value))


# --- info -------------------------------------------------------------------------------

STAT_SECTIONS: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    (
        "Traffic",
        (
            ("packets_in", "packets in"),
            ("packets_out", "packets out"),
            ("bytes_in", "bytes in"),
            ("bytes_out", "bytes out"),
            ("dropped", "dropped"),
        ),
    ),
    (
        "Probes",
        (
            ("probes_sent", "sent"),
            ("probes_failed", "failed"),
            ("indirect_probes_sent", "indirect sent"),
            ("nacks_received", "nacks received"),
            ("tcp_fallback_probes", "TCP fallbacks"),
            ("tcp_fallback_rescues", "TCP rescues"),
            ("urgent_probes", "urgent"),
            ("urgent_probes_failed", "urgent failed"),
        ),
    ),
    (
        "Suspicion",
        (
            ("suspicions_raised", "raised"),
            ("suspicion_verifications", "verifications"),
            ("cross_check_probes", "cross-checks"),
            ("cross_check_probes_failed", "cross-checks failed"),
            ("suspicions_held_starved", "held while starved"),
            ("refutations", "refutations"),
            ("deaths_declared", "deaths declared"),
            ("address_conflicts", "name conflicts"),
        ),
    ),
    (
        "Agent loop",
        (
            ("broadcast_queue", "broadcast queue"),
            ("stalls", "stalls"),
            ("stall_datagrams", "stall datagrams"),
        ),
    ),
    (
        "Event handlers",
        (
            ("handler_runs", "runs"),
            ("handler_failures", "failures"),
            ("handler_timeouts", "timeouts"),
            ("handler_dropped", "dropped"),
            ("handler_coalesced", "coalesced"),
            ("handler_queued", "queued"),
        ),
    ),
    (
        "Access",
        (
            ("control_refused_connections", "refused connections"),
            ("control_refused_requests", "refused requests"),
            ("key_file_warnings", "key file warnings"),
        ),
    ),
)
"""``info``'s ``stats`` grouped for reading, with their labels; a stat not named here goes
under "Other" with its key as the label."""
_AGENT_FIELDS = ("node", "addr", "port", "version", "profile", "encrypted", "uptime_ms")
_HANDLED = {*_AGENT_FIELDS, "incarnation", "health_score", "members", "tags", "stats"}


def info_text(info: Mapping[str, Any]) -> str:
    agent = [
        Row("node", str(info.get("node", "-"))),
        Row("address", f"{info.get('addr', '-')}:{info.get('port', '-')}"),
        Row("version", str(info.get("version", "-"))),
        Row("profile", str(info.get("profile", "-"))),
        Row("encrypted", "yes" if info.get("encrypted") else "no"),
    ]
    if "uptime_ms" in info:
        agent.append(Row("uptime", duration_ms(info["uptime_ms"])))
    agent += [
        Row("incarnation", count(info.get("incarnation", 0))),
        Row("health score", f"{info.get('health_score', 0)} (Lifeguard awareness; 0 is healthy)"),
    ]
    members: dict[str, int] = dict(info.get("members", {}))
    member_rows = [Row(s, count(n), True) for s, n in members.items()]
    if member_rows:
        member_rows.append(Row("total", count(sum(members.values())), True))
    tags = [Row(k, v) for k, v in sorted(dict(info.get("tags", {})).items())]
    stats: dict[str, Any] = dict(info.get("stats", {}))
    blocks: list[tuple[str, Sequence[Row]]] = [("Agent", agent), ("Members", member_rows)]
    blocks.append(("Tags", tags))
    for title, keys in STAT_SECTIONS:
        rows = [row for k, lbl in keys if k in stats for row in value_rows(k, stats.pop(k), lbl)]
        blocks.append((title, rows))
    other = [row for k, v in sorted(stats.items()) for row in value_rows(k, v)]
    other += [row for k, v in sorted(info.items()) if k not in _HANDLED for row in value_rows(k, v)]
    blocks.append(("Other", other))
    return sections(blocks)


# --- members ----------------------------------------------------------------------------


def members_text(members: Sequence[Mapping[str, Any]]) -> str:
    rows = [("Name", "Address", "Status", "Incarnation", "Phi", "Tags")]
    for m in members:
        phi = "-" if m["phi"] is None else f"{m['phi']:.2f}"
        tags = ",".join(f"{k}={v}" for k, v in sorted(m["tags"].items()))
        rows.append(
            (m["name"], f"{m['addr']}:{m['port']}", m["status"], str(m["incarnation"]), phi, tags)
        )
    return table(rows, right=(3, 4))


class FilterError(ValueError):
    """A filter that cannot be used; the message names the option and says why."""


def compile_regex(option: str, typed: str, expr: str) -> re.Pattern[str]:
    """``expr`` compiled; ``FilterError`` quotes the option as typed (``--tag 'k=('``)."""
    try:
        return re.compile(expr)
    except re.error as exc:
        raise FilterError(f"{option} {typed!r}: not a valid regular expression ({exc})") from None


@dataclass(frozen=True, slots=True)
class MemberFilter:
    """``serf members``' filters (rules in the module docstring)."""

    name: re.Pattern[str] | None = None
    status: re.Pattern[str] | None = None
    tags: tuple[tuple[str, re.Pattern[str]], ...] = ()

    @classmethod
    def parse(cls, name: str | None, status: str | None, tags: Iterable[str]) -> MemberFilter:
        """From the options as typed; ``FilterError`` names the bad one."""
        parsed: list[tuple[str, re.Pattern[str]]] = []
        for arg in tags:
            key, sep, expr = arg.partition("=")
            if not sep or not key:
                raise FilterError(f"--tag expects KEY=REGEX, got {arg!r}")
            parsed.append((key, compile_regex("--tag", arg, expr)))
        status_re = None if status is None else compile_regex("--status", status, status)
        if status_re is not None and not any(status_re.fullmatch(s) for s in STATUSES):
            raise FilterError(f"--status {status!r} matches none of {', '.join(STATUSES)}")
        name_re = None if name is None else compile_regex("--name", name, name)
        return cls(name_re, status_re, tuple(parsed))

    def __call__(self, m: Mapping[str, Any]) -> bool:
        tags: Mapping[str, str] = m.get("tags", {})
        return (
            all(r.fullmatch(tags.get(key, "")) for key, r in self.tags)
            and (self.status is None or bool(self.status.fullmatch(str(m["status"]))))
            and (self.name is None or bool(self.name.fullmatch(str(m["name"]))))
        )


# --- jobs -------------------------------------------------------------------------------


def view_text(view: Mapping[str, Any], now_ms: int) -> str:
    """One job's view: a summary line, then its nodes in the view's order (join age), each
    with its role. ``Global ranks`` numbers the training nodes in join order (a spare has
    none, ``-``); a spare that replaced a failed node holds that node's ranks instead,
    which only its trainers know."""
    members: list[Mapping[str, Any]] = list(view["members"])
    training = [m for m in members if m.get("role", ROLE_TRAINING) == ROLE_TRAINING]
    spares = len(members) - len(training)
    world = sum(int(m.get("ranks", 1)) for m in training)
    head = (
        f"Job {view['job']}: generation {view['generation']}, fingerprint "
        f"{view['fingerprint']}, {len(training)} training node(s), {world} rank(s), "
        f"{spares} spare(s)"
    )
    rows = [
        (
            "Node",
            "Address",
            "Status",
            "Role",
            "Ranks",
            "Global ranks",
            "Store port",
            "Registered",
            "Group",
        )
    ]
    first = 0
    for m in members:
        n = int(m.get("ranks", 1))
        role = str(m.get("role", ROLE_TRAINING))
        age = duration_ms(max(now_ms - int(m["registered_ms"]), 0))
        rows.append(
            (
                m["name"],
                f"{m['addr']}:{m['port']}",
                m["status"],
                role,
                str(n),
                ranges([(first, first + n - 1)]) if role == ROLE_TRAINING else "-",
                str(m["store_port"]) if m["store_port"] else "-",
                f"{age} ago",
                m["group"] or "-",
            )
        )
        if role == ROLE_TRAINING:
            first += n
    return head + "\n" + table(rows, right=(4, 6))


def slow_text(slow: Mapping[str, float]) -> str:
    """Flagged nodes, slowest first: ``n2 (3.01x)``."""
    order = sorted(slow, key=lambda n: (-slow[n], n))
    return ", ".join(f"{n} ({slow[n]:.2f}x)" for n in order) or "-"


def _training(job: Mapping[str, Any]) -> str:
    """Training nodes, and the target where this agent's trainers reported one: ``2/3``."""
    training = str(job.get("training", job["nodes"]))
    return training if job.get("target") is None else f"{training}/{job['target']}"


def jobs_text(result: Mapping[str, Any]) -> str:
    head = ("Job", "Generation", "Training", "Spares", "Ranks", "Hung", "Local ranks", "Paused")
    rows = [(*head, "Slow", "Fingerprint")]
    for j in result["jobs"]:
        paused = ", ".join(
            f"{p['local_rank']} ({p['reason']}, {max(p['left_ms'], 0) // 1000} s left)"
            for p in j.get("paused", ())
        )
        rows.append(
            (
                j["job"],
                str(j["generation"]),
                _training(j),
                str(j.get("spares", 0)),
                str(j["ranks"]),
                str(j["hung"]),
                str(j["local_ranks"]),
                paused or "-",
                slow_text(j.get("slow") or {}),
                j["fingerprint"],
            )
        )
    text = table(rows, right=(1, 2, 3, 4, 5, 6))
    if result.get("omitted"):
        text += f"\n({result['omitted']} more job(s) not listed)"
    return text


# --- version ----------------------------------------------------------------------------


def version_text(v: Mapping[str, Any], program: str = "swimctl") -> str:
    gossip, serf = v["gossip_protocol"], v["serf_protocol"]
    return "\n".join(
        [
            f"{program} {v['version']}",
            f"Gossip protocol (memberlist): {gossip['max']} (understands back to: {gossip['min']})",
            f"Serf protocol: {serf['max']} (understands back to: {serf['min']})",
            f"Control API: {v['control_protocol']}",
        ]
    )
