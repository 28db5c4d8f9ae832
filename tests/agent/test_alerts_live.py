"""The shipped alerts, fired for real: Debian's Prometheus scrapes 5 agent processes (the
``fast`` profile, ``--metrics-addr``) every second and evaluates packaging/alerts.yml
(unchanged: SwimMemberDead has no ``for``) every second; Debian's Alertmanager
(``prometheus-alertmanager``) posts to a webhook receiver in this process (a thread).

- A member whose name is hostile (quotes, a newline, a backslash, bytes that are not UTF-8)
  is gossiped in and dies: every target still scrapes, and its alert names it as
  agent/member_metrics.py spells it.
- SIGKILL one agent: SwimMemberDead fires naming it, one alert however many agents see it.
- Restart it with the same name and ports: the alert resolves (``send_resolved``).

Everything listens on 127.0.0.1, on free ports, with its storage in the test's directory,
and is stopped by pid at the end. The seconds from the SIGKILL to the firing webhook and
from the restart (process start) to the resolved one are printed: figures for
docs/runbook.md, not assertions. Reproduce:
``.venv/bin/pytest -s tests/agent/test_alerts_live.py``.
"""

from __future__ import annotations

import json
import random
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from agent.demo import LocalAgent, wait_converged
from agent.member_metrics import member_label
from agent.procs import free_port, stop, until
from swim import Address, Alive, Config, Node, encode_message, encode_packet

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = shutil.which("prometheus")
ALERTMANAGER = shutil.which("prometheus-alertmanager")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        PROMETHEUS is None or ALERTMANAGER is None,
        reason="needs Debian's prometheus and prometheus-alertmanager (scripts/setup.sh)",
    ),
]

AGENTS = 5
GHOST = 'gpu-"13"\n\\ \udcff'
"""A member name as hostile as the wire allows (``surrogateescape`` keeps the byte 0xff)."""


@dataclass
class Webhook:
    """Alertmanager's webhook posts, with the monotonic time each arrived."""

    posts: list[tuple[float, dict[str, Any]]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def alerts(self, since: float = 0.0) -> list[tuple[float, dict[str, Any]]]:
        with self.lock:
            return [(t, a) for t, post in self.posts if t >= since for a in post["alerts"]]

    def first(self, member: str, status: str, since: float = 0.0) -> tuple[float, Any] | None:
        for t, alert in self.alerts(since):
            labels = alert["labels"]
            if (
                labels["alertname"] == "SwimMemberDead"
                and labels["member"] == member
                and alert["status"] == status
            ):
                return t, alert
        return None


@contextmanager
def webhook_receiver() -> Iterator[tuple[Webhook, int]]:
    hook = Webhook()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            with hook.lock:
                hook.posts.append((time.monotonic(), json.loads(body)))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield hook, server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


@contextmanager
def started(args: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
        try:
            yield proc
        finally:
            stop(proc)


def http_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())


def ready(url: str, proc: subprocess.Popen[bytes], log: Path) -> bool:
    if proc.poll() is not None:
        raise RuntimeError(f"{log.stem} exited: {log.read_text(errors='replace')[-2000:]}")
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def query(prom: int, expr: str) -> list[dict[str, Any]]:
    url = f"http://127.0.0.1:{prom}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    result: list[dict[str, Any]] = http_json(url)["data"]["result"]
    return result


def rule_alerts(prom: int, member: str) -> list[dict[str, Any]]:
    """Prometheus' active SwimMemberDead alerts for ``member``."""
    alerts = http_json(f"http://127.0.0.1:{prom}/api/v1/alerts")["data"]["alerts"]
    return [
        a
        for a in alerts
        if a["labels"]["alertname"] == "SwimMemberDead" and a["labels"].get("member") == member
    ]


def gossip_ghost(port: int) -> None:
    """Announce a member nobody runs, at a port nobody listens on: the agents probe it,
    suspect it and declare it dead, as they would any crashed node."""
    nowhere = Address("127.0.0.1", free_port())
    # the protocol versions a fast-profile member announces, as the real agents do
    vsn = Node("x", nowhere, rng=random.Random(0), now_ms=0, config=Config.fast()).members()[0].vsn
    alive = Alive(1, GHOST, nowhere.ip_bytes, nowhere.port, vsn=bytes(vsn))
    data = encode_packet([encode_message(alive)], compress=False, crc=False, crypto=None)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        udp.sendto(data, ("127.0.0.1", port))


def test_a_killed_agent_fires_a_named_alert_and_its_restart_resolves_it(tmp_path: Path) -> None:
    assert PROMETHEUS is not None and ALERTMANAGER is not None
    prom_port, am_port = free_port(), free_port()
    metrics_ports = [free_port() for _ in range(AGENTS)]
    with ExitStack() as stack:
        hook, hook_port = stack.enter_context(webhook_receiver())
        (tmp_path / "am.yml").write_text(
            json.dumps(
                {
                    "route": {
                        "receiver": "hook",
                        "group_by": ["alertname", "member"],
                        "group_wait": "0s",
                        "group_interval": "1s",
                        "repeat_interval": "1h",
                    },
                    "receivers": [
                        {
                            "name": "hook",
                            "webhook_configs": [
                                {"url": f"http://127.0.0.1:{hook_port}/", "send_resolved": True}
                            ],
                        }
                    ],
                }
            )
        )
        am_log = tmp_path / "alertmanager.log"
        am = stack.enter_context(
            started(
                [
                    ALERTMANAGER,
                    f"--config.file={tmp_path / 'am.yml'}",
                    f"--storage.path={tmp_path / 'am-data'}",
                    f"--web.listen-address=127.0.0.1:{am_port}",
                    "--cluster.listen-address=",  # no gossip port for an HA peer
                ],
                am_log,
            )
        )
        (tmp_path / "prometheus.yml").write_text(
            json.dumps(
                {
                    "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                    "rule_files": [str(ROOT / "packaging" / "alerts.yml")],
                    "alerting": {
                        "alertmanagers": [
                            {"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}
                        ]
                    },
                    "scrape_configs": [
                        {
                            "job_name": "swim",
                            "scrape_timeout": "1s",
                            "static_configs": [
                                {"targets": [f"127.0.0.1:{p}" for p in metrics_ports]}
                            ],
                        }
                    ],
                }
            )
        )
        prom_log = tmp_path / "prometheus.log"
        prom = stack.enter_context(
            started(
                [
                    PROMETHEUS,
                    f"--config.file={tmp_path / 'prometheus.yml'}",
                    f"--storage.tsdb.path={tmp_path / 'prom-data'}",
                    f"--web.listen-address=127.0.0.1:{prom_port}",
                ],
                prom_log,
            )
        )

        def agent(i: int, join: int | None, bind: list[str] | None = None) -> LocalAgent:
            extra = ["--metrics-addr", f"127.0.0.1:{metrics_ports[i]}", *(bind or [])]
            return LocalAgent(f"gpu-{i + 1:02d}", tmp_path, "fast", join, extra)

        agents = [agent(0, None)]

        def stop_agents() -> None:
            for a in agents:
                a.stop(signal.SIGKILL)

        stack.callback(stop_agents)
        for i in range(1, AGENTS):
            agents.append(agent(i, agents[0].port))
        for a in agents:
            a.wait_ready(20)
        until(lambda: ready(f"http://127.0.0.1:{am_port}/-/ready", am, am_log), 20, "alertmanager")
        until(lambda: ready(f"http://127.0.0.1:{prom_port}/-/ready", prom, prom_log), 20, "prom")
        wait_converged(agents, 20)
        until(
            lambda: len(query(prom_port, 'up{job="swim"} == 1')) == AGENTS,
            20,
            "prometheus scrapes every agent",
        )

        # a hostile name: the pages stay valid, the alert names it as the agents spell it
        gossip_ghost(agents[0].port)
        until(
            lambda: hook.first(member_label(GHOST), "firing"),
            20,
            "the ghost's alert reaches the webhook",
        )
        # every agent's page, the hostile label on it, was scraped and stored as spelled
        until(
            lambda: (
                {
                    (r["metric"]["instance"], r["metric"]["member"])
                    for r in query(prom_port, 'swim_member_unhealthy{status="dead"}')
                }
                == {(f"127.0.0.1:{p}", member_label(GHOST)) for p in metrics_ports}
            ),
            10,
            "every agent reports the ghost dead",
        )

        victim = agents[2]
        # We got here just after an evaluation (the ghost's webhook): kill at a random
        # point of the 1 s scrape and evaluation cycle, or every run measures the same phase.
        time.sleep(random.uniform(0, 1))
        killed = time.monotonic()
        victim.stop(signal.SIGKILL)
        until(lambda: hook.first(victim.name, "firing", killed), 25, f"{victim.name} fires")
        fired_at, alert = hook.first(victim.name, "firing", killed) or (0.0, {})
        assert alert["annotations"]["summary"].startswith(f"{victim.name} is dead (seen by ")
        assert "instance" not in alert["labels"]  # one alert, not one per reporting agent
        assert alert["labels"]["severity"] == "warning"
        # once every survivor reports it: still one alert, which says so
        summary = f"{victim.name} is dead (seen by {AGENTS - 1} agents)"
        until(
            lambda: (
                [a["annotations"]["summary"] for a in rule_alerts(prom_port, victim.name)]
                == [summary]
            ),
            10,
            summary,
        )

        time.sleep(random.uniform(0, 1))  # a random phase again (see above)
        restarted = time.monotonic()
        agents[2] = agent(2, agents[0].port, ["--bind", f"127.0.0.1:{victim.port}"])
        until(lambda: hook.first(victim.name, "resolved", restarted), 25, f"{victim.name} resolves")
        resolved_at, _ = hook.first(victim.name, "resolved", restarted) or (0.0, {})
        (tmp_path / "webhook.json").write_text(json.dumps([p for _, p in hook.posts], indent=1))
        print(
            f"\nkill -> firing webhook {fired_at - killed:.2f} s; "
            f"restart -> resolved webhook {resolved_at - restarted:.2f} s"
        )
