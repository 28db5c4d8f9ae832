"""Event handlers, ours against Serf's: the same recording handler run by a real
``serf agent`` (Debian's serf 0.9.4) and by our agent, observing one mixed cluster through
the same join, tag change, graceful leave, failure (SIGKILL), user event and query, gives
the same records (env and stdin), field by field; both answer the query with their
handler's output.

What must differ, and is normalised before comparing (docs/runbook.md "Reacting to verdicts:
event handlers"):
- ``SERF_SELF_NAME`` and the observer's own stdin line: each observer is itself (both are
  written as ``OBSERVER``);
- ``SWIM_CONTROL``: ours only;
- grouping: Serf coalesces member events over a quiescent second, ours only when they wait in
  the queue together, so records are compared as lines (event, member line), not as runs;
- the order of the tags on a stdin line (Go's map order is random; ours are sorted).
The user event's ``SERF_USER_LTIME`` and the query's ``SERF_QUERY_LTIME`` are the same on
both: each is one gossiped message.
"""

from __future__ import annotations

import json
import signal
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agent.procs import stop, until
from bench.procs import SERF, LocalAgent, LocalSerf, SerfError

pytestmark = pytest.mark.skipif(
    SERF is None, reason="serf not installed (scripts/setup.sh installs it with apt-get)"
)
RECORDER = Path(__file__).with_name("handler_record.py")
OBSERVER_TAGS = {"role": "observer", "gpu.kind": "h100", "rack": "a-3"}
SPREAD_S = 30


def _records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def _members(record: dict[str, Any]) -> list[str]:
    if not record["env"]["SERF_EVENT"].startswith("member-"):
        return []
    return [line.split("\t")[0] for line in record["stdin"].splitlines()]


def _seen(path: Path, event: str, *names: str) -> bool:
    found = {n for r in _records(path) if r["env"]["SERF_EVENT"] == event for n in _members(r)}
    return set(names) <= found


def _lines(records: list[dict[str, Any]], observers: set[str]) -> Counter[tuple[str, ...]]:
    """(env, stdin line) per stdin line, normalised as the module docstring says. A
    repeated member-update line counts once: Serf 0.9.4 hands a member-update again with
    its next flush of member events (serf/coalesce_member.go keeps it pending)."""
    out: Counter[tuple[str, ...]] = Counter()
    for r in records:
        env = dict(r["env"])
        assert env.pop("SERF_SELF_NAME") in observers
        env.pop("SWIM_CONTROL", None)
        env_key = json.dumps(env, sort_keys=True)
        if not env["SERF_EVENT"].startswith("member-"):
            out[(env_key, r["stdin"])] += 1
            continue
        for line in r["stdin"].splitlines():
            name, addr, role, tags = line.split("\t")
            name = "OBSERVER" if name in observers else name
            key = (env_key, name, addr, role, ",".join(sorted(tags.split(","))))
            if env["SERF_EVENT"] != "member-update" or key not in out:
                out[key] += 1
    return out


def _history(records: list[dict[str, Any]], name: str) -> list[str]:
    """The events one member appeared in, in order, repeats collapsed."""
    seen: list[str] = []
    for r in records:
        if name in _members(r) and (not seen or seen[-1] != r["env"]["SERF_EVENT"]):
            seen.append(r["env"]["SERF_EVENT"])
    return seen


def _serf(command: Callable[[], None], what: str) -> None:
    """A serf command, retried while its agent is busy."""

    def done() -> bool:
        command()
        return True

    until(done, 10, what, ignore=(SerfError,))


def test_serf_and_swim_handlers_get_the_same_records(tmp_path: Path) -> None:
    outs = {"serf": tmp_path / "serf.jsonl", "swim": tmp_path / "swim.jsonl"}
    handler = f"{sys.executable} {RECORDER}"
    serfs: list[LocalSerf] = []
    swims: list[LocalAgent] = []

    def on_both(what: str, seen: Callable[[Path], bool]) -> None:
        took = [
            until(lambda o=out: seen(o), SPREAD_S, f"{side}'s handler: {what}")  # type: ignore[misc]
            for side, out in outs.items()
        ]
        print(f"{what}: {sum(took):.1f} s", flush=True)  # where the test's time goes (-s)

    try:
        obs_serf = LocalSerf(
            "obs-serf",
            tmp_path,
            tags=OBSERVER_TAGS,
            extra=[f"-event-handler={handler} {outs['serf']}"],
        )
        serfs.append(obs_serf)
        obs_serf.wait_ready()
        tag_args = [a for k, v in OBSERVER_TAGS.items() for a in ("--tag", f"{k}={v}")]
        handler_args = ["--event-handler", f"{handler} {outs['swim']}"]
        obs_swim = LocalAgent("obs-swim", tmp_path, "local", obs_serf.port, tag_args + handler_args)
        swims.append(obs_swim)
        obs_swim.wait_ready(20)
        on_both("observers joined", lambda o: _seen(o, "member-join", "obs-serf", "obs-swim"))
        # a serf member and one of ours join
        s1 = LocalSerf("s1", tmp_path, join=obs_serf.port, tags={"role": "serf", "zone": "z1"})
        serfs.append(s1)
        w1 = LocalAgent("w1", tmp_path, "local", obs_serf.port, ["--tag", "role=swim"])
        swims.append(w1)
        on_both("s1 and w1 joined", lambda o: _seen(o, "member-join", "s1", "w1"))
        _serf(lambda: s1.set_tags(zone="z2"), "serf tags")
        on_both("s1 updated", lambda o: _seen(o, "member-update", "s1"))
        # the leave before the kill: a leaver gossips its leave a few times only, some of
        # them to recently dead members (as in tests/agent/test_serf_interop.py)
        s1.leave()
        on_both("s1 left", lambda o: _seen(o, "member-leave", "s1"))
        stop(w1.proc, sig=signal.SIGKILL)
        on_both("w1 failed", lambda o: _seen(o, "member-failed", "w1"))
        _serf(lambda: obs_serf.user_event("deploy", "v1.2"), "serf event")
        on_both("user event", lambda o: any(r["env"]["SERF_EVENT"] == "user" for r in _records(o)))
        # a query: each handler's output is its node's answer
        answers = obs_serf.query("ping", "hello")
    finally:
        for s in serfs:
            s.stop(signal.SIGKILL)
        for w in swims:
            w.stop(signal.SIGKILL)
    serf_records, swim_records = _records(outs["serf"]), _records(outs["swim"])
    observers = {"obs-serf", "obs-swim"}
    assert _lines(serf_records, observers) == _lines(swim_records, observers)
    for name in ("s1", "w1"):
        assert _history(serf_records, name) == _history(swim_records, name), name
    assert answers["Responses"] == {
        "obs-serf": "pong from obs-serf: hello\n",
        "obs-swim": "pong from obs-swim: hello\n",
    }
    assert [r["env"]["SERF_QUERY_NAME"] for r in swim_records if "SERF_QUERY_NAME" in r["env"]] == [
        "ping"
    ]
    assert _history(swim_records, "s1") == ["member-join", "member-update", "member-leave"]
    assert _history(swim_records, "w1") == ["member-join", "member-failed"]
    user = [r["env"] for r in swim_records if r["env"]["SERF_EVENT"] == "user"]
    assert user[0]["SERF_USER_EVENT"] == "deploy" and user[0]["SERF_USER_LTIME"].isdigit()
    assert all(r["env"]["SWIM_CONTROL"] == str(obs_swim.control) for r in swim_records)
