"""The agent's side of fail-slow detection (agent/slow_jobs.py): a trainer's ``slow``
report checked and recorded, the ``job-slow`` event for handlers, ``swimctl jobs``, the
metrics; and one agent in this process fed by a real watch connection."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any
from urllib.request import urlopen

import pytest
import trio

from agent.cli_format import jobs_text, slow_text
from agent.control import ControlClient
from agent.handlers import HandlerEvent, handler_env, handler_stdin, job_slow_event, parse_handler
from agent.jobs import JobError
from agent.procs import free_port, until_async
from agent.slow_jobs import MAX_SLOW_NODES, SlowJobs, check_slow
from tests.agent.test_agent import cluster
from torchhook.client import Membership

RECORDER = Path(__file__).with_name("handler_record.py")


@pytest.mark.parametrize(
    "report",
    [
        None,
        {},
        {"nodes": []},
        {"nodes": {"": 2.0}},
        {"nodes": {"n": "2"}},
        {"nodes": {"n": True}},
        {"nodes": {"n": math.inf}},
        {"nodes": {"n": -1.0}},
        {"nodes": {f"n{i}": 2.0 for i in range(MAX_SLOW_NODES + 1)}},
    ],
)
def test_a_bad_report_is_refused(report: Any) -> None:
    with pytest.raises(JobError, match="slow"):
        check_slow(report)


def test_reports_change_the_flagged_set_and_count_new_flags() -> None:
    slow = SlowJobs()
    assert check_slow({"nodes": {"n2": 3}}) == {"n2": 3.0}
    first = slow.update("j", {"n2": 3.0}, 1000)
    assert first is not None and first.newly == ("n2",) and first.cleared == ()
    assert slow.update("j", {"n2": 3.1}, 2000) is None  # the same set: no event
    report = slow.get("j")
    assert report is not None and report.since_ms == {"n2": 1000}
    both = slow.update("j", {"n1": 1.6, "n2": 3.1}, 3000)
    assert both is not None and both.newly == ("n1",)
    cleared = slow.update("j", {}, 4000)
    assert cleared is not None and cleared.cleared == ("n1", "n2")
    assert slow.summary("j") == {"slow": {}, "slow_flags": 2}
    slow.forget("j")
    assert slow.summary("j") == {"slow": {}, "slow_flags": 0}


def test_job_slow_goes_only_to_handlers_that_name_it() -> None:
    event = job_slow_event("llm", {"n1": 1.6, "n2": 3.014}, ["n2"])
    assert not parse_handler("/bin/all").wants(event)
    assert not parse_handler("job-view=/bin/x").wants(event)
    assert parse_handler("job-slow=/bin/x").wants(event)
    assert parse_handler("job-slow:llm=/bin/x").wants(event)
    assert not parse_handler("job-slow:other=/bin/x").wants(event)
    env = handler_env(event, "me", {}, "/s")
    assert (env["SERF_EVENT"], env["SWIM_JOB"], env["SWIM_SLOW_NODES"]) == (
        "job-slow",
        "llm",
        "n2,n1",
    )
    assert handler_stdin(event) == b"n2\t\t\tnew=1,ratio=3.01\nn1\t\t\tnew=0,ratio=1.60\n"
    cleared = job_slow_event("llm", {}, [])
    assert handler_env(cleared, "me", {}, "/s")["SWIM_SLOW_NODES"] == ""
    assert handler_stdin(cleared) == b""
    assert not parse_handler("job-slow:llm=/bin/x").wants(HandlerEvent("job-view", "llm"))


def test_swimctl_jobs_shows_the_slow_nodes() -> None:
    assert slow_text({}) == "-"
    assert slow_text({"a": 1.5, "b": 3.0}) == "b (3.00x), a (1.50x)"
    job = {"job": "j", "generation": 1, "nodes": 3, "ranks": 3, "hung": 0, "local_ranks": 1}
    job |= {"fingerprint": "ab", "slow": {"n2": 3.0}, "slow_flags": 1}
    text = jobs_text({"jobs": [job], "omitted": 0})
    assert "Slow" in text.splitlines()[0] and "n2 (3.00x)" in text


async def _job(client: ControlClient) -> dict[str, Any]:
    (job,) = (await trio.to_thread.run_sync(client.request, "jobs"))["jobs"]
    return dict(job)


@pytest.mark.trio
async def test_a_trainers_report_reaches_handlers_jobs_and_metrics(tmp_path: Path) -> None:
    out = tmp_path / "slow.jsonl"
    metrics_port = free_port()
    async with cluster(
        tmp_path,
        1,
        event_handlers=[f"job-slow:llm={sys.executable} {RECORDER} {out}"],
        metrics_addr=f"127.0.0.1:{metrics_port}",
    ):
        path = tmp_path / "n0.sock"
        rank = await trio.to_thread.run_sync(lambda: Membership("llm", control=path))
        try:
            rank.report_slow({"n0": 2.5})
            await until_async(out.exists, 10, "the job-slow handler ran")
            client = ControlClient(path, timeout_s=5)
            job = await _job(client)
            assert (job["slow"], job["slow_flags"]) == ({"n0": 2.5}, 1)
            url = f"http://127.0.0.1:{metrics_port}/metrics"
            page = await trio.to_thread.run_sync(lambda: urlopen(url, timeout=5).read().decode())
            assert 'swim_job_slow_nodes{job="llm"} 1.0' in page
            assert 'swim_job_slow_flags_total{job="llm"} 1.0' in page
            status = await trio.to_thread.run_sync(
                lambda: json.loads(urlopen(url.replace("/metrics", "/v1/jobs"), timeout=5).read())
            )
            assert status["jobs"][0]["local"]["slow"] == {"n0": 2.5}
            rank.report_slow({})
            await until_async(lambda: len(out.read_text().splitlines()) == 2, 10, "cleared")
            # a bad report is refused and counted; the connection stays
            rank._send({"slow": {"nodes": {"n0": "fast"}}})
            with trio.fail_after(10):
                while (await _job(client))["refused_frames"] != 1:
                    await trio.sleep(0.05)
            assert rank.closed is None
        finally:
            rank.close()
    first, second = (json.loads(line) for line in out.read_text().splitlines())
    assert first["env"]["SWIM_SLOW_NODES"] == "n0"
    assert first["stdin"] == "n0\t\t\tnew=1,ratio=2.50\n"
    assert second["env"]["SWIM_SLOW_NODES"] == "" and second["stdin"] == ""
