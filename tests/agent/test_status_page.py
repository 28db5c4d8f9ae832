"""The status page in a real headless Chromium (Debian's ``chromium``), against real agent
processes on loopback: the page renders the cluster (members, health, a job's local ranks
and steps, a hot spare, the events), renders a hostile member name and tag as text,
filters and sorts, and a SIGKILLed member turns dead on the page without a reload; when
its own agent dies the page says so. The browser is driven over the DevTools protocol on a pipe
(tests/agent/chromium.py); one browser serves the module. A screenshot is kept under the
test's temporary directory (its path is printed). Every process is stopped by pid."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.demo import LocalAgent, wait_converged
from agent.procs import free_port, stop, until
from tests.agent.chromium import Chromium, chromium_binary
from torchhook.client import Membership

pytestmark = pytest.mark.skipif(
    chromium_binary() is None, reason="needs chromium (scripts/setup.sh installs it)"
)
HOSTILE_NAME = "<img src=x onerror=alert(1)>"
HOSTILE_TAG = "<script>document.title='owned'</script>"
ROWS = "[...document.querySelectorAll('#members tbody tr')]"


@pytest.fixture(scope="module")
def browser() -> Iterator[Chromium]:
    with Chromium() as chromium:
        yield chromium


def _members(browser: Chromium) -> dict[str, str]:
    rows = browser.evaluate(f"{ROWS}.map((r) => [r.dataset.name, r.dataset.status])")
    return dict(rows)


def _cells(browser: Chromium, selector: str) -> list[str]:
    found = browser.evaluate(
        f"(() => {{ const r = document.querySelector({json.dumps(selector)});"
        " return r ? [...r.cells].map((c) => c.textContent) : null; })()"
    )
    assert found is not None, f"nothing matches {selector}"
    return list(found)


def _set_filter(browser: Chromium, text: str, status: str = "") -> list[str]:
    names: list[str] = browser.evaluate(
        f"(() => {{ const f = document.getElementById('filter');"
        f" f.value = {json.dumps(text)}; f.dispatchEvent(new Event('input'));"
        f" const s = document.getElementById('status-filter');"
        f" s.value = {json.dumps(status)}; s.dispatchEvent(new Event('change'));"
        f" return {ROWS}.map((r) => r.dataset.name); }})()"
    )
    return names


def test_the_page_shows_the_cluster_and_a_killed_member_turns_dead(
    browser: Chromium, tmp_path: Path
) -> None:
    metrics_port = free_port()
    agents: list[LocalAgent] = []
    watches: list[Membership] = []
    try:
        page_agent = LocalAgent(
            "agent-0",
            tmp_path,
            "local",
            None,
            ["--metrics-addr", f"127.0.0.1:{metrics_port}", "--tag", "role=trainer"],
        )
        agents.append(page_agent)
        page_agent.wait_ready(20)
        for name, tags in (
            ("agent-1", ["--tag", "role=trainer", "--tag", "rack=r2"]),
            ("agent-2", ["--tag", "role=trainer"]),
            (HOSTILE_NAME, ["--tag", f"note={HOSTILE_TAG}"]),
        ):
            agents.append(LocalAgent(name, tmp_path, "local", page_agent.port, tags))
        for a in agents:
            a.wait_ready(20)
        names = {a.name for a in agents}
        wait_converged(agents, 30)
        # a job on the page's node: two local ranks, stepping
        for rank in (0, 1):
            watch = Membership(
                "train", control=page_agent.control, local_rank=rank, local_world_size=2
            )
            watches.append(watch)
            watch.heartbeat(7)

        browser.navigate(f"http://127.0.0.1:{metrics_port}/")
        browser.evaluate("window.sameDocument = true")  # gone if the page reloads
        until(
            lambda: _members(browser) == dict.fromkeys(names, "alive"),
            20,
            "every member alive on the page",
        )
        job = "#jobs tr[data-job=train]"
        until(
            lambda: (
                browser.evaluate(f"document.querySelector({json.dumps(job)}) !== null")
                and _cells(browser, job)[7:9] == ["2/2", "0:7 1:7"]
            ),
            10,
            "the job, its local ranks and their steps on the page",
        )
        assert _cells(browser, job)[:4] == ["train", "1", "0", "2"]  # one node, two ranks
        # agent-1 joins the job as a hot spare: counted apart, marked under Members
        spare = Membership("train", control=agents[1].control)
        watches.append(spare)
        spare._send({"role": "spare"})
        until(
            lambda: _cells(browser, job)[:4] == ["train", "1", "1", "2"],
            20,
            "the spare on the page",
        )
        assert "agent-1 [spare]" in _cells(browser, job)[10]
        with watches[1].paused("checkpoint", 60):  # a declared pause shows with its reason
            until(
                lambda: _cells(browser, job)[9] == "1 paused (checkpoint)",
                10,
                "the paused rank on the page",
            )
        health = browser.evaluate("document.getElementById('health').textContent")
        assert "health score" in health and "agent-0" in browser.evaluate("document.title")

        # hostile strings are text: no image element, no extra script, the name as typed
        hostile = _cells(browser, f"#members tbody tr[data-name={json.dumps(HOSTILE_NAME)}]")
        assert hostile[0] == HOSTILE_NAME and hostile[7] == f"note={HOSTILE_TAG}"
        assert browser.evaluate("document.images.length") == 0
        assert browser.evaluate("document.scripts.length") == 1

        # filter by text and status, sort by a column
        assert _set_filter(browser, "rack=r2") == ["agent-1"]
        assert _set_filter(browser, "", "dead") == []
        assert len(_set_filter(browser, "")) == len(agents)
        order: list[str] = browser.evaluate(
            "document.querySelector('#members th[data-key=name]').click();"
            f"{ROWS}.map((r) => r.dataset.name)"
        )
        assert order == sorted(names, reverse=True)

        updates = int(browser.evaluate("document.body.dataset.updates"))
        victim = agents[2]
        stop(victim.proc, sig=signal.SIGKILL)
        took = until(lambda: _members(browser).get(victim.name) == "dead", 40, "dead on the page")
        print(f"\n{victim.name} turned dead on the page {took:.1f} s after its SIGKILL")
        assert browser.evaluate("window.sameDocument") is True
        assert int(browser.evaluate("document.body.dataset.updates")) > updates
        events: list[list[Any]] = browser.evaluate(
            "[...document.querySelectorAll('#events tbody tr')]"
            ".map((r) => [...r.cells].map((c) => c.textContent))"
        )
        assert any(e[1] == "dead" and e[2] == victim.name for e in events)
        shot = browser.screenshot(tmp_path / "status-page.png")
        print(f"screenshot: {shot}")
        assert shot.stat().st_size > 10_000

        # the page's own agent dies: the page says so, still without a reload
        stop(page_agent.proc, sig=signal.SIGKILL)
        until(
            lambda: (
                browser.evaluate("document.getElementById('conn').textContent")
                == "agent unreachable"
            ),
            10,
            "the page notices its agent is gone",
        )
        assert browser.evaluate("window.sameDocument") is True
    finally:
        for watch in watches:
            watch.close()
        for a in agents:
            a.stop(signal.SIGKILL)
