"""Runs the event handlers (the contract is agent/handlers.py) without ever holding the
protocol back.

Rules:
- The node task only *offers* an event (``HandlerRunner.offer``): a handler that wants it
  gets it queued, nothing else happens there. One task (``run``) takes events from the
  queue in order and runs every handler that wants each, in the configured order, one at a
  time per agent (Serf's agent does the same): a slow, failing or hanging handler delays
  only the handlers after it, never a probe or a gossip.
- The queue is bounded (``QUEUE_DEPTH`` events): an event that finds it full is dropped,
  counted (``stats``: ``handler_dropped``) and logged once per overflow burst.
- Member events of one kind waiting next to each other are handed over as one event, one
  stdin line per member (Serf's coalescing, ``agent.handlers.coalesce``).
- Each run has ``timeout_ms``; at its end the handler's whole process group (it runs in a
  session of its own) gets SIGKILL, and the run counts as ``handler_timeouts``. The group
  is also killed when the agent stops mid-run.
- A handler's stdout and stderr go to the agent log, at most ``MAX_OUTPUT_BYTES`` per run
  (its tail, as Serf keeps the tail); a non-zero exit is a warning. A query's handler's
  output (if any) is the query's answer, as in Serf: the first handler that prints
  answers.
- ``follow_job_views`` turns job view changes into ``job-view`` events (only started when
  a handler asks for them), recomputing at most every ``JOB_VIEW_INTERVAL_MS``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import trio

from agent.api import AgentAPI
from agent.config import AgentConfig
from agent.control import default_control_path
from agent.driver import Driver, now_ms
from agent.handlers import (
    JOB_VIEW,
    ROLE_TAG,
    HandlerEvent,
    HandlerSpec,
    RecentUserEvents,
    coalesce,
    handler_env,
    handler_stdin,
    job_slow_event,
    job_view_event,
    member_event,
)
from agent.jobs import MAX_WATCHED_JOBS, TAG_PREFIX
from agent.serf.delegate import QueryReceived, UserEventReceived
from agent.serf_runtime import SerfRuntime
from agent.watch import member_tags
from swim import EventKind, MemberEvent

log = logging.getLogger("swim.agent")

DEFAULT_TIMEOUT_MS = 30_000
"""A handler's run time before its process group is killed: long enough for an
``scontrol`` or a page to a pager, short enough that a hung one frees the queue."""
QUEUE_DEPTH = 1024
"""Events waiting for the handlers: a whole 1,000-node cluster failing at once fits (and
those coalesce); beyond it events are dropped and counted, memory stays bounded."""
MAX_OUTPUT_BYTES = 8 * 1024
"""A run's output kept for the log (and a query's answer): Serf's ``maxBufSize``."""
SLOW_MS = 1_000
"""A run longer than this is logged as slow (Serf's ``warnSlow``)."""
JOB_VIEW_INTERVAL_MS = 100
"""Job views are recomputed for handlers at most this often: a view walks every member,
and a flapping cluster changes many times a second."""
SHELL = "/bin/sh"

Reply = Callable[[object, bytes], Awaitable[None]]
SelfInfo = Callable[[], tuple[str, Mapping[str, str]]]


class HandlerRunner:
    """The handlers of one agent: ``offer`` events (never blocks), ``await run()``."""

    def __init__(
        self,
        specs: Sequence[HandlerSpec],
        *,
        self_info: SelfInfo,
        control_path: str,
        timeout_ms: int = DEFAULT_TIMEOUT_MS,
        depth: int | None = None,
        reply: Reply | None = None,
    ) -> None:
        self.specs = tuple(specs)
        self._self_info = self_info
        self._control_path = control_path
        self._timeout_ms = timeout_ms
        self._depth = QUEUE_DEPTH if depth is None else depth
        self._reply = reply
        self._queue: deque[HandlerEvent] = deque()
        self._wake = trio.Event()
        self._overflowing = 0
        self.runs = 0
        self.failures = 0
        self.timeouts = 0
        self.dropped = 0
        self.coalesced = 0

    @property
    def wants_job_views(self) -> bool:
        return any(f.event == JOB_VIEW for s in self.specs for f in s.filters)

    def stats(self) -> dict[str, int]:
        """The counters for ``info``'s ``stats``."""
        return {
            "handler_runs": self.runs,
            "handler_failures": self.failures,
            "handler_timeouts": self.timeouts,
            "handler_dropped": self.dropped,
            "handler_coalesced": self.coalesced,
            "handler_queued": len(self._queue),
        }

    def register_metrics(self, registry: Any) -> None:
        """Export the counters on a Prometheus registry (the agent's, agent/metrics.py):
        ``swim_event_handler_runs_total``, ``..._failures_total``, ``..._timeouts_total``,
        ``..._dropped_total`` and the ``swim_event_handler_queue_depth`` gauge."""
        from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily

        runner = self

        class Collector:
            def collect(self) -> Iterator[Any]:
                for name, value, what in (
                    ("runs", runner.runs, "Event handler runs."),
                    ("failures", runner.failures, "Event handler runs that exited non-zero."),
                    ("timeouts", runner.timeouts, "Event handler runs killed at the timeout."),
                    ("dropped", runner.dropped, "Events dropped: the handler queue was full."),
                ):
                    yield CounterMetricFamily(f"swim_event_handler_{name}", what, value=value)
                yield GaugeMetricFamily(
                    "swim_event_handler_queue_depth",
                    "Events waiting for the event handlers.",
                    value=len(runner._queue),
                )

        registry.register(Collector())

    def offer(self, event: HandlerEvent) -> bool:
        """Queue ``event`` if a handler wants it (called in the node task: no await)."""
        if not any(spec.wants(event) for spec in self.specs):
            return False
        if len(self._queue) >= self._depth:
            self.dropped += 1
            if not self._overflowing:
                log.warning(
                    "event handlers: queue full (%d events), dropping %s events",
                    self._depth,
                    event.kind,
                )
            self._overflowing += 1
            return False
        self._queue.append(event)
        self._wake.set()
        return True

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            while not self._queue:
                if self._overflowing:
                    log.warning("event handlers: %d events dropped", self._overflowing)
                    self._overflowing = 0
                self._wake = trio.Event()
                await self._wake.wait()
            event = self._queue.popleft()
            while self._queue:
                merged = coalesce(event, self._queue[0])
                if merged is None:
                    break
                self._queue.popleft()
                self.coalesced += 1
                event = merged
            await self._handle(event)

    async def _handle(self, event: HandlerEvent) -> None:
        name, tags = self._self_info()
        env = {**os.environ, **handler_env(event, name, tags, self._control_path)}
        stdin = handler_stdin(event)
        answered = False
        for spec in self.specs:
            if not spec.wants(event):
                continue
            output = await self.invoke(spec, event, env, stdin)
            if (
                output
                and event.kind == "query"
                and not answered
                and self._reply is not None
                and event.reply is not None
            ):
                answered = True
                await self._reply(event.reply, output)

    async def invoke(
        self, spec: HandlerSpec, event: HandlerEvent, env: Mapping[str, str], stdin: bytes
    ) -> bytes | None:
        """One run: ``/bin/sh -c COMMAND`` in its own session; its output's tail when it
        exits 0, else None (logged)."""
        self.runs += 1
        started = trio.current_time()
        try:
            proc = await trio.lowlevel.open_process(
                [SHELL, "-c", spec.command],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=dict(env),
                start_new_session=True,
            )
        except OSError as exc:
            self.failures += 1
            log.error("event handler %r: cannot start: %s", spec.command, exc)
            return None
        output = bytearray()
        total = 0
        try:
            with trio.move_on_after(self._timeout_ms / 1000) as scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(_feed, proc.stdin, stdin)
                    assert proc.stdout is not None
                    while chunk := await proc.stdout.receive_some(65536):
                        total += len(chunk)
                        output += chunk
                        del output[:-MAX_OUTPUT_BYTES]
                    await proc.wait()
        finally:
            if proc.returncode is None or scope.cancelled_caught:
                _kill_group(proc.pid)
                with trio.CancelScope(shield=True):
                    await proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    with trio.CancelScope(shield=True):
                        await pipe.aclose()
        took_ms = int((trio.current_time() - started) * 1000)
        text = output.decode("utf-8", "replace").rstrip("\n")
        if total > MAX_OUTPUT_BYTES:
            text = f"[{total - MAX_OUTPUT_BYTES} bytes cut] {text}"
        what = f"event handler {spec.command!r} for {_describe(event)}"
        if scope.cancelled_caught:
            self.timeouts += 1
            log.warning("%s: killed after %d ms (timeout); output: %s", what, took_ms, text)
            return None
        if took_ms > SLOW_MS:
            log.warning("%s: slow, took %d ms", what, took_ms)
        if proc.returncode != 0:
            self.failures += 1
            log.warning("%s: exit status %s; output: %s", what, proc.returncode, text)
            return None
        if text:
            log.info("%s: output: %s", what, text)
        return bytes(output)

    async def follow_job_views(
        self,
        changed: Callable[[], trio.Event],
        job_views: Callable[[Iterable[str]], Awaitable[list[HandlerEvent]]],
    ) -> None:
        """Offer a ``job-view`` event whenever a job's view changes. ``job_views(known)``:
        the views of these jobs and of every job seen in members' tags. A job whose view
        became empty is announced once, then forgotten."""
        last: dict[str, str] = {}
        while True:
            event = changed()
            for view in await job_views(list(last)):
                news = last.get(view.name) != view.fingerprint
                if news and (view.members or view.name in last):
                    self.offer(view)
                if view.members:
                    last[view.name] = view.fingerprint
                    while len(last) > MAX_WATCHED_JOBS:
                        del last[next(iter(last))]
                else:
                    last.pop(view.name, None)
            await event.wait()
            await trio.sleep(JOB_VIEW_INTERVAL_MS / 1000)


async def _feed(stdin: trio.abc.SendStream | None, data: bytes) -> None:
    """Write a handler's stdin and close it; a handler that does not read it is fine."""
    if stdin is None:
        return
    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        if data:
            await stdin.send_all(data)
        await stdin.aclose()


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _describe(event: HandlerEvent) -> str:
    if event.name:
        return f"{event.kind}:{event.name}"
    if event.members:
        return f"{event.kind} ({', '.join(m.name for m in event.members[:8])})"
    return event.kind


async def start_handlers(
    nursery: trio.Nursery,
    agent: AgentAPI,
    config: AgentConfig,
    driver: Driver,
    serf_runtime: SerfRuntime,
) -> HandlerRunner:
    """The agent's event handlers, fed from the driver's member events, the Serf layer's
    user events and queries, and (if a handler asks) job view changes."""
    runner = HandlerRunner(
        config.event_handlers,
        self_info=lambda: (agent.name, agent.tags),
        control_path=str(config.control or default_control_path()),
        timeout_ms=config.event_handler_timeout_ms,
        reply=lambda token, output: _answer(driver, serf_runtime, token, output),
    )
    recent = RecentUserEvents()

    def on_member(event: MemberEvent) -> None:
        m = event.member
        found = member_event(event.kind, m.name, m.address.host, member_tags(m))
        if found is not None:
            runner.offer(found)

    def on_user(event: UserEventReceived) -> None:
        if recent.is_news(event.ltime, event.name, event.payload):
            runner.offer(HandlerEvent("user", event.name, event.ltime, event.payload))

    def on_query(received: QueryReceived) -> None:
        q = received.query
        token = _Query(received, now_ms() + q.timeout_ns // 1_000_000)
        runner.offer(HandlerEvent("query", q.name, q.ltime, q.payload, reply=token))

    async def job_views(known: Iterable[str]) -> list[HandlerEvent]:
        members = await agent.live_members()
        tags = {m.name: member_tags(m) for m in members}
        jobs = set(known)
        jobs.update(
            k.removeprefix(TAG_PREFIX) for t in tags.values() for k in t if k.startswith(TAG_PREFIX)
        )
        roles = {name: t.get(ROLE_TAG, "") for name, t in tags.items()}
        return [
            job_view_event(agent.jobs.view(job, members, lambda m: tags[m.name]), roles)
            for job in sorted(jobs)[:MAX_WATCHED_JOBS]
        ]

    driver.on_member_event = on_member
    agent.jobs.on_slow = lambda c: runner.offer(job_slow_event(c.job, c.nodes, c.newly))
    serf_runtime.on_user_event = on_user
    serf_runtime.on_query = on_query
    await nursery.start(runner.run)
    # Serf hands its handlers its own join first (memberlist notifies the local node's
    # join too); our core emits none for itself.
    node = driver.node
    own = member_event(EventKind.JOINED, node.name, node.address.host, agent.tags)
    if own is not None:
        runner.offer(own)
    if runner.wants_job_views:
        nursery.start_soon(runner.follow_job_views, lambda: agent.changed, job_views)
    return runner


async def _answer(driver: Driver, serf_runtime: SerfRuntime, token: object, output: bytes) -> None:
    """A query handler's output as the query's answer, unless the query's time is over
    (serf's ``Query.Respond`` checks its deadline too)."""
    if not isinstance(token, _Query):
        return
    if now_ms() > token.deadline_ms:
        log.warning(
            "query %s: answered after the query's timeout: not sent", token.received.query.name
        )
        return
    await driver.command(lambda t: serf_runtime.answer_query(token.received, output))


@dataclass(frozen=True, slots=True)
class _Query:
    """What answering a query needs: the query and the end of its time (serf: receipt +
    the query's timeout)."""

    received: QueryReceived
    deadline_ms: int
