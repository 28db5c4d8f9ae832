"""Event handlers: the contract's pure parts (filters, environment, stdin, coalescing; rules
in agent/handlers.py), the runner on real processes (a hanging handler is killed with its
process group at its timeout, output is bounded, a failing handler does not stop the next;
agent/handler_runner.py), and agents in this process: a flood overflows the bounded queue,
counted, while the agent keeps answering ``info``; a job view change reaches a
``job-view`` handler. The comparison with a real Serf agent is
tests/agent/test_handlers_serf.py."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any
from urllib.request import urlopen

import pytest
import trio
from click.testing import CliRunner

import agent.handler_runner as handler_runner
from agent import serf
from agent.cli import main
from agent.config import AgentConfigError, load
from agent.control import ControlClient
from agent.handler_runner import MAX_OUTPUT_BYTES, HandlerRunner
from agent.handlers import (
    EventFilter,
    HandlerConfigError,
    HandlerEvent,
    MemberLine,
    RecentUserEvents,
    coalesce,
    handler_env,
    handler_stdin,
    job_view_event,
    member_event,
    parse_handler,
    tag_env_name,
)
from agent.procs import free_port, until_async
from swim import EventKind
from tests.agent.test_agent import cluster

RECORDER = Path(__file__).with_name("handler_record.py")
JOIN = HandlerEvent("member-join", members=(MemberLine("n1", "10.0.0.1", {}),))


# --- filters ------------------------------------------------------------------------------


def test_a_handler_without_filter_gets_every_serf_event_but_not_job_views() -> None:
    spec = parse_handler("/usr/local/bin/all")
    assert spec.command == "/usr/local/bin/all"
    assert spec.filters == (EventFilter("*"),)
    for kind in ("member-join", "member-failed", "user", "query", "member-reap"):
        assert spec.wants(HandlerEvent(kind))
    assert not spec.wants(HandlerEvent("job-view", "llm"))


def test_filters_as_serf_parses_them() -> None:
    spec = parse_handler("member-failed,user:deploy,query,job-view:llm=/bin/x --flag=1")
    assert spec.command == "/bin/x --flag=1", "split at the first '='"
    assert spec.filters == (
        EventFilter("member-failed"),
        EventFilter("user", "deploy"),
        EventFilter("query"),
        EventFilter("job-view", "llm"),
    )
    assert spec.wants(HandlerEvent("member-failed"))
    assert not spec.wants(HandlerEvent("member-join"))
    assert spec.wants(HandlerEvent("user", "deploy"))
    assert not spec.wants(HandlerEvent("user", "other"))
    assert spec.wants(HandlerEvent("query", "anything"))
    assert spec.wants(HandlerEvent("job-view", "llm"))
    assert not spec.wants(HandlerEvent("job-view", "other"))
    assert parse_handler("user:=/x").wants(HandlerEvent("user", "any")), "serf: user: is user"
    assert parse_handler("*=/x").wants(JOIN)


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("member-died=/x", "'member-died'"),
        ("member-join,=/x", "''"),
        ("member-join:n1=/x", "'member-join:n1'"),
        ("member-join=", "no command"),
        ("", "no command"),
    ],
)
def test_a_bad_handler_is_an_error_naming_it(text: str, names: str) -> None:
    with pytest.raises(HandlerConfigError, match=names):
        parse_handler(text)


def test_handlers_in_toml_and_flags_are_validated_and_kept_in_order(tmp_path: Path) -> None:
    file = tmp_path / "agent.toml"
    file.write_text('event_handlers = ["member-failed=/a", "/b"]\nevent_handler_timeout_ms = 500\n')
    config = load(file, {"event_handlers": ("user:x=/c",)})
    assert [h.command for h in config.event_handlers] == ["/a", "/b", "/c"]
    assert config.event_handler_timeout_ms == 500
    with pytest.raises(AgentConfigError, match="'member-lost'"):
        load(None, {"event_handlers": ("member-lost=/x",)})
    with pytest.raises(AgentConfigError, match="event_handler_timeout_ms"):
        load(None, {"event_handler_timeout_ms": 0})
    file.write_text("event_handlers = [1]\n")
    with pytest.raises(AgentConfigError, match="event_handlers"):
        load(file)


# --- what a handler is given ------------------------------------------------------------------


def test_environment_as_serf_sets_it() -> None:
    tags = {"role": "web", "gpu.kind": "h100", "rack-a": "3", "_x": "y"}
    env = handler_env(JOIN, "me", tags, "/run/swim/agent.sock")
    assert env == {
        "SERF_EVENT": "member-join",
        "SERF_SELF_NAME": "me",
        "SERF_SELF_ROLE": "web",
        "SERF_TAG_ROLE": "web",
        "SERF_TAG_GPU_KIND": "h100",
        "SERF_TAG_RACK_A": "3",
        "SERF_TAG__X": "y",
        "SWIM_CONTROL": "/run/swim/agent.sock",
    }
    assert handler_env(JOIN, "me", {}, "/s")["SERF_SELF_ROLE"] == "", "empty without a role"
    assert tag_env_name("zoné") == "SERF_TAG_ZON_"
    user = handler_env(HandlerEvent("user", "deploy", 7, b"v1"), "me", {}, "/s")
    assert (user["SERF_USER_EVENT"], user["SERF_USER_LTIME"]) == ("deploy", "7")
    query = handler_env(HandlerEvent("query", "uptime", 9), "me", {}, "/s")
    assert (query["SERF_QUERY_NAME"], query["SERF_QUERY_LTIME"]) == ("uptime", "9")
    job = handler_env(
        HandlerEvent("job-view", "llm", generation=3, fingerprint="ab"), "m", {}, "/s"
    )
    assert (job["SWIM_JOB"], job["SWIM_JOB_GENERATION"], job["SWIM_JOB_FINGERPRINT"]) == (
        "llm",
        "3",
        "ab",
    )
    assert "\0" not in handler_env(JOIN, "me", {"k": "a\0b"}, "/s")["SERF_TAG_K"]


def test_stdin_as_serf_writes_it() -> None:
    event = HandlerEvent(
        "member-failed",
        members=(
            MemberLine("n1", "10.0.0.1", {"zone": "z", "role": "gpu"}),
            MemberLine("odd\tname\n", "fd00::1", {"role": "a\tb"}),
            MemberLine("bare", "10.0.0.3", {}),
        ),
    )
    assert handler_stdin(event) == (
        b"n1\t10.0.0.1\tgpu\trole=gpu,zone=z\n"
        b"odd\\tname\\n\tfd00::1\ta\\tb\trole=a\\tb\n"
        b"bare\t10.0.0.3\t\t\n"
    )
    assert handler_stdin(HandlerEvent("user", "x", payload=b"v1")) == b"v1\n"
    assert handler_stdin(HandlerEvent("user", "x", payload=b"v1\n")) == b"v1\n"
    assert handler_stdin(HandlerEvent("query", "x")) == b""


def test_member_events_map_to_serf_names() -> None:
    names = {
        kind: (e.kind if (e := member_event(kind, "n", "1.2.3.4", {})) else None)
        for kind in EventKind
    }
    assert names == {
        EventKind.JOINED: "member-join",
        EventKind.UPDATED: "member-update",
        EventKind.SUSPECT: None,
        EventKind.ALIVE: None,
        EventKind.DEAD: "member-failed",
        EventKind.LEFT: "member-leave",
        EventKind.REAPED: "member-reap",
    }


def test_queued_member_events_of_one_kind_coalesce() -> None:
    a = HandlerEvent("member-failed", members=(MemberLine("a", "1", {}),))
    b = HandlerEvent("member-failed", members=(MemberLine("b", "2", {}),))
    a2 = HandlerEvent("member-failed", members=(MemberLine("a", "9", {}),))
    merged = coalesce(coalesce(a, b) or a, a2)
    assert merged is not None
    assert [(m.name, m.addr) for m in merged.members] == [("b", "2"), ("a", "9")]
    assert coalesce(a, JOIN) is None
    assert coalesce(HandlerEvent("user", "x"), HandlerEvent("user", "x")) is None


def test_job_views_become_member_lines() -> None:
    view = {
        "job": "llm",
        "generation": 4,
        "fingerprint": "f00",
        "members": [
            {
                "name": "gpu1",
                "addr": "10.0.0.1",
                "port": 7946,
                "store_port": 29500,
                "registered_ms": 17,
                "group": "g1",
                "status": "alive",
                "ranks": 8,
            }
        ],
    }
    event = job_view_event(view, {"gpu1": "trainer"})
    assert (event.kind, event.name, event.generation, event.fingerprint) == (
        "job-view",
        "llm",
        4,
        "f00",
    )
    assert handler_stdin(event) == (
        b"gpu1\t10.0.0.1\ttrainer\t"
        b"group=g1,ranks=8,registered_ms=17,role=trainer,status=alive,store_port=29500\n"
    )
    view["members"][0]["role"] = "spare"  # type: ignore[index]
    assert b",job_role=spare," in handler_stdin(job_view_event(view, {}))


def test_a_user_event_is_handed_over_once() -> None:
    recent = RecentUserEvents(limit=2)
    assert recent.is_news(1, "deploy", b"v1")
    assert not recent.is_news(1, "deploy", b"v1")
    assert recent.is_news(2, "deploy", b"v1")
    assert recent.is_news(3, "deploy", b"v1")
    assert recent.is_news(1, "deploy", b"v1"), "forgotten beyond the bound"


# --- the runner, on real processes ----------------------------------------------------------


def _runner(tmp_path: Path, *handlers: str, timeout_ms: int = 5_000) -> HandlerRunner:
    return HandlerRunner(
        [parse_handler(h) for h in handlers],
        self_info=lambda: ("me", {"role": "r"}),
        control_path=str(tmp_path / "agent.sock"),
        timeout_ms=timeout_ms,
    )


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


@pytest.mark.trio
async def test_a_hanging_handler_and_its_children_are_killed_at_the_timeout(
    tmp_path: Path,
) -> None:
    pids = tmp_path / "pids"
    hang = f"sleep 60 & echo $! > {pids}; echo $$ >> {pids}; echo started; wait"
    runner = _runner(tmp_path, hang, timeout_ms=300)
    started = trio.current_time()
    env = {"PATH": os.environ["PATH"]}
    assert await runner.invoke(runner.specs[0], JOIN, env, b"") is None
    assert trio.current_time() - started < 5
    assert runner.timeouts == 1
    for pid in map(int, pids.read_text().split()):
        await until_async(lambda p=pid: _gone(p), 5, f"pid {pid} killed")  # type: ignore[misc]


@pytest.mark.trio
async def test_handlers_run_in_order_with_bounded_output_and_failures_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out = tmp_path / "order"
    runner = _runner(
        tmp_path,
        f"echo first >> {out}; exit 3",
        f"member-join=head -c 100000 /dev/zero | tr '\\0' x; echo second >> {out}",
        f"user=echo never >> {out}",
        f"member-join=echo third >> {out}",
    )
    caplog.set_level(logging.INFO, logger="swim.agent")
    async with trio.open_nursery() as nursery:
        await nursery.start(runner.run)
        assert runner.offer(JOIN)
        assert not _runner(tmp_path, "user=/x").offer(JOIN), "nobody wants it: not queued"
        await until_async(lambda: runner.runs == 3 and runner.stats()["handler_queued"] == 0, 10)
        nursery.cancel_scope.cancel()
    assert out.read_text().split() == ["first", "second", "third"]
    assert runner.failures == 1
    logged = [r.getMessage() for r in caplog.records if "event handler" in r.getMessage()]
    assert any("exit status 3" in m for m in logged)
    cut = [m for m in logged if "bytes cut" in m]
    assert cut and all(len(m) < MAX_OUTPUT_BYTES + 500 for m in cut)


# --- agents in this process ---------------------------------------------------------------


def _user_event(ltime: int) -> bytes:
    return serf.encode_user_event(serf.UserEvent(ltime, "flood", b"x"))


@pytest.mark.trio
async def test_a_flood_overflows_the_bounded_queue_while_the_agent_answers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(handler_runner, "QUEUE_DEPTH", 8)
    hang = "user=sleep 30"
    metrics_port = free_port()
    async with cluster(
        tmp_path,
        1,
        event_handlers=[hang],
        event_handler_timeout_ms=60_000,
        metrics_addr=f"127.0.0.1:{metrics_port}",
    ) as agents:
        agent = agents[0].agent
        assert agent.serf is not None
        serf_runtime = agent.serf

        def flood(now: int) -> None:
            for ltime in range(1, 51):
                serf_runtime.on_user_message(_user_event(ltime))
            serf_runtime.on_user_message(_user_event(1))  # a repeat: not news, not queued

        await agent.command(flood)
        client = ControlClient(tmp_path / "n0.sock", timeout_s=5)
        info: dict[str, Any] = await trio.to_thread.run_sync(client.request, "info")
        stats = info["stats"]
        assert stats["handler_dropped"] == 50 - 8, stats
        assert stats["handler_runs"] <= 1 and stats["handler_queued"] >= 7, stats
        members = await trio.to_thread.run_sync(client.request, "members")
        assert [m["name"] for m in members] == ["n0"]
        url = f"http://127.0.0.1:{metrics_port}/metrics"
        page = await trio.to_thread.run_sync(lambda: urlopen(url, timeout=5).read().decode())
        assert "swim_event_handler_dropped_total 42.0" in page


@pytest.mark.trio
async def test_a_job_view_change_reaches_a_job_view_handler(tmp_path: Path) -> None:
    out = tmp_path / "views.jsonl"
    handler = f"job-view:llm={sys.executable} {RECORDER} {out}"
    async with cluster(tmp_path, 1, event_handlers=[handler]) as agents:
        agent = agents[0].agent
        await agent.update_tags({"swim.job/llm": "17,29500,ok,g1,2", "role": "trainer"}, [])
        await until_async(out.exists, 10, "the job-view handler ran")
        await agent.update_tags({}, ["swim.job/llm"])
        await until_async(lambda: len(out.read_text().splitlines()) == 2, 10, "the view emptied")
    first, second = (json.loads(line) for line in out.read_text().splitlines())
    assert first["env"]["SERF_EVENT"] == "job-view"
    assert first["env"]["SWIM_JOB"] == "llm"
    assert first["env"]["SWIM_JOB_GENERATION"] == "1"
    assert first["env"]["SWIM_CONTROL"] == str(tmp_path / "n0.sock")
    assert first["stdin"] == (
        "n0\t127.0.0.1\ttrainer\tgroup=g1,ranks=2,registered_ms=17,role=trainer,"
        "status=alive,store_port=29500\n"
    )
    assert second["env"]["SWIM_JOB_GENERATION"] == "2"
    assert second["stdin"] == ""


def test_a_bad_filter_on_the_command_line_stops_the_agent_naming_it() -> None:
    result = CliRunner().invoke(main, ["agent", "--event-handler", "member-dead=/bin/true"])
    assert result.exit_code == 2
    assert "'member-dead'" in result.output
