"""The agent: a ``swim.Node`` driven on trio, composed of parts that each own one concern.

Parts (docs/design.md §2 "Who owns what"):
- ``Driver`` (agent/driver.py) alone owns the Node: its inbox, its timers, executing its
  Outputs. Everything else reaches the Node through ``Driver.command``.
- ``Transport`` (agent/transport.py): UDP and TCP on one port (``SocketTransport``), or the
  in-memory network of agent/memory_transport.py in tests.
- ``SerfRuntime`` (agent/serf_runtime.py): the agent as a Serf member (intents, Lamport
  clocks, queries, push-pull user state), called by the driver in the node task.
- ``Events`` (agent/events.py): the events fan-out for ``monitor`` and ``watch``.
- ``JobRegistry`` (agent/registrations.py): this node's training-job registrations.
- ``ControlServer`` (agent/control_server.py) and the job watch (agent/watch.py) use the
  agent only through ``agent.api.AgentAPI``, which ``Agent`` implements.

``Agent`` itself is the composition and the lifecycle: bind, start, join and retry-join,
the systemd watchdog, graceful leave, SIGHUP reload and the signals (``run_agent``).
Every direct sign of life from a peer feeds the Phi accrual registry (in the driver).
Time is trio's clock in integer milliseconds, so tests run on a MockClock.
"""

from __future__ import annotations

import functools
import logging
import random
import signal
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import trio

import agent.systemd as systemd
from agent import keyfiles, serf
from agent.access import Access
from agent.api import Snapshot
from agent.config import AgentConfig, AgentConfigError
from agent.config import load as load_config
from agent.control import ControlError
from agent.control_server import ControlServer
from agent.departed import Departed
from agent.driver import Driver, now_ms
from agent.events import Events
from agent.handler_runner import HandlerRunner, start_handlers
from agent.jobs import TAG_PREFIX
from agent.netif import interface_address
from agent.registrations import JobRegistry
from agent.serf_runtime import SerfRuntime
from agent.transport import SocketTransport, Transport
from phi import PhiConfig, PhiRegistry
from swim import Address, Member, Node

if TYPE_CHECKING:
    from agent.metrics import AgentMetrics

log = logging.getLogger("swim.agent")

MAX_META_BYTES = 512
"""memberlist MetaMaxSize."""
PHI_WINDOW = 200
"""Samples per peer: enough for a stable estimate, bounded memory (capacity × window × 8 B)."""
LEAVE_POLL_S = 0.05
"""How often a leaving agent checks whether its dead-from-self has been gossiped out."""


class Agent:
    """A running member. ``await Agent(config).run()`` until it leaves or is cancelled.

    ``transport``: where it sends and receives (default: sockets bound at ``config.bind``);
    ``control``: whether to serve the control socket (``config.control``).
    """

    def __init__(
        self,
        config: AgentConfig,
        *,
        rng: random.Random | None = None,
        transport: Transport | None = None,
        control: bool = True,
    ) -> None:
        self.config = config
        self.swim_config = config.swim_config()
        # key files, the saved keyring and the advertised interface: agent/keyfiles.py,
        # agent/netif.py; each error names its setting, before anything is bound
        keyfiles.prepare_data_dir(config)
        keys = keyfiles.start_keys(config)  # logs where the keyring came from
        self.keyring, self._keys_saved_to = keys.keyring, keys.save_to
        self.key_file_warnings = keyfiles.exposure_warnings(config, keys)  # logs each
        self._advertise_host = (
            None
            if config.advertise_interface is None
            else interface_address(config.advertise_interface)
        )
        self._rng = rng if rng is not None else random.Random()
        self._transport = transport
        self._serve_control = control
        self._tags: dict[str, str] = dict(config.tags)
        self.phi = PhiRegistry(
            PhiConfig(
                max_sample_size=PHI_WINDOW,
                acceptable_heartbeat_pause_ms=0,
                first_heartbeat_estimate_ms=self.swim_config.probe_interval_ms,
            ),
            config.phi_capacity,
        )
        self.events = Events()
        self.departed = Departed(config.reconnect_timeout_ms, config.tombstone_timeout_ms)
        self.jobs = JobRegistry(lambda: self._tags, self.update_tags)
        self.metrics: AgentMetrics | None = None  # only with --metrics-addr
        self.metrics_port = 0  # the HTTP server's bound port (metrics and status page)
        self.handlers: HandlerRunner | None = None  # only with event handlers
        self.access: Access | None = None  # the control socket's rules and refusal counts
        self.driver: Driver | None = None
        self.serf: SerfRuntime | None = None
        self.bound_port = 0
        self.started_ms = 0
        self.ready = trio.Event()
        self.stopped = trio.Event()
        self.shutdown_requested = trio.Event()
        self._leaving = False

    # --- the parts ------------------------------------------------------------------------

    @property
    def node(self) -> Node | None:
        """The Node, for reading in tests and metrics; only the driver changes it."""
        return None if self.driver is None else self.driver.node

    def _parts(self) -> tuple[Driver, SerfRuntime]:
        if self.driver is None or self.serf is None:
            raise RuntimeError("the agent is not running")
        return self.driver, self.serf

    @property
    def name(self) -> str:
        return self.config.node

    @property
    def tags(self) -> Mapping[str, str]:
        return MappingProxyType(self._tags)

    @property
    def changed(self) -> trio.Event:
        return self.events.changed

    async def command(self, run: Callable[[int], Any]) -> Any:
        """Run ``run(now_ms)`` in the node task and return its result (or raise its error)."""
        return await self._parts()[0].command(run)

    # --- lifecycle ------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Bind, join, serve until ``shutdown_requested``; then leave gracefully."""
        cfg = self.config
        transport = self._transport
        if transport is None:
            transport = await SocketTransport.bind(cfg.bind.host, cfg.bind.port)
        self.bound_port = transport.address.port
        advertise = transport.address
        if cfg.advertise is not None:
            advertise = Address(cfg.advertise.host, cfg.advertise.port)
        elif self._advertise_host is not None:
            advertise = Address(self._advertise_host, self.bound_port)
        node = Node(
            cfg.node,
            advertise,
            rng=self._rng,
            now_ms=now_ms(),
            config=self.swim_config,
            meta=serf.encode_tags(self._tags),
            keyring=self.keyring,
        )
        # Probe rounds are numbered on the wall clock, so that agents agree on them
        # (coordinated_probes, swim/schedule.py); trio's clock starts anywhere per process.
        # Taken once: a later step of the wall clock only unaligns the rounds, it breaks
        # nothing (each agent still probes one member per round).
        node.set_clock_offset_ms(int(time.time() * 1000) - now_ms())
        driver = Driver(
            node,
            transport,
            phi=self.phi,
            events=self.events,
            tcp_timeout_ms=self.swim_config.tcp_timeout_ms,
        )
        serf_runtime = SerfRuntime(
            driver,
            departed=self.departed,
            tags=lambda: self._tags,
            keyring_file=self._keys_saved_to,
        )
        driver.delegate = serf_runtime
        self.jobs.evidence.enabled = cfg.early_drop()
        self.jobs.stall.enabled = cfg.stall_drop()
        self.jobs.notify_changed = self.events.notify_changed
        driver.on_probe_refused = self.jobs.probe_refused
        self.driver, self.serf = driver, serf_runtime
        self.started_ms = now_ms()
        log.info(
            "agent %s listening on %s (udp+tcp), advertising %s, profile %s%s",
            cfg.node,
            f"{cfg.bind.host}:{self.bound_port}",
            advertise,
            cfg.profile,
            ", encrypted" if self.keyring else "",
        )
        control: ControlServer | None = None
        try:
            if self._serve_control:
                # bound before the nursery: a bad group or a socket in use is a plain error
                self.access = Access(cfg.control_group, cfg.admin_group)
                control = ControlServer(self, cfg.control, self.access)
                control.bind()
            async with trio.open_nursery() as nursery:
                await nursery.start(driver.run)
                if control is not None:
                    await nursery.start(control.serve)
                if cfg.event_handlers:
                    self.handlers = await start_handlers(nursery, self, cfg, driver, serf_runtime)
                if cfg.metrics_addr is not None:
                    # prometheus_client costs ~10 MB resident: load it only when asked for
                    from agent.job_metrics import register_job_metrics
                    from agent.metrics import AgentMetrics
                    from agent.metrics_http import serve_metrics
                    from agent.watch import member_tags

                    self.metrics = AgentMetrics(
                        node, self.phi_values, members=self.all_members, now_ms=now_ms
                    )
                    if self.handlers is not None:
                        self.handlers.register_metrics(self.metrics.registry)
                    self.jobs.slow.register_metrics(self.metrics.registry)
                    register_job_metrics(
                        self.metrics.registry, node.members, member_tags, self.jobs.targets
                    )
                    driver.on_probe_rtt_ms = self.metrics.observe_probe_rtt_ms
                    serve = functools.partial(serve_metrics, agent=self)  # + the status page
                    self.metrics_port = await nursery.start(
                        serve, self.metrics, cfg.metrics_addr.host, cfg.metrics_addr.port
                    )
                await driver.command(lambda t: driver.apply(node.start(t)))
                await driver.command(lambda t: serf_runtime.send_join_intent())
                if cfg.join:
                    result = await self.join(list(cfg.join))
                    if not result["joined"]:
                        log.warning("could not join any of %s: %s", cfg.join, result["errors"])
                if cfg.retry_join:
                    nursery.start_soon(self._retry_join)
                nursery.start_soon(self._watchdog)
                self.ready.set()
                systemd.notify("READY=1")
                task_status.started()
                await self.shutdown_requested.wait()
                await self.leave_cluster()
                nursery.cancel_scope.cancel()
        finally:
            systemd.notify("STOPPING=1")
            transport.close()
            self.events.close()
            self.stopped.set()
            log.info("agent %s stopped", cfg.node)

    async def leave_cluster(self) -> None:
        """Serf's leave: a leave intent first (so Serf peers say "left", not "failed"),
        then memberlist's dead-from-self, then wait until it has been gossiped out."""
        driver, serf_runtime = self._parts()
        node = driver.node
        if self._leaving:
            return
        self._leaving = True

        def intent(now: int) -> None:
            serf_runtime.leaving = True
            serf_runtime.send_leave_intent(node.name, direct=True)

        await driver.command(intent)
        # Serf peers must see the intent before memberlist's dead, or they call it failed
        # (serf.go handleNodeLeave); Serf waits LeavePropagateDelay, we wait less.
        await trio.sleep(self.config.leave_propagate_delay_ms / 1000)
        await driver.command(lambda t: driver.apply(node.leave(t)))
        with trio.move_on_after(self.config.leave_timeout_ms / 1000):
            while not await driver.command(lambda t: node.leave_done):
                await trio.sleep(LEAVE_POLL_S)
        done = await driver.command(lambda t: node.leave_done)
        log.info("left the cluster%s", "" if done else " (leave not confirmed)")

    async def leave(self) -> None:
        await self.leave_cluster()
        self.request_shutdown()

    def request_shutdown(self) -> None:
        self.shutdown_requested.set()

    async def reload(self) -> None:
        """SIGHUP: re-read the config file; apply tags and log level (others need a restart)."""
        if self.config.config_file is None:
            log.info("SIGHUP: no config file to reload")
            return
        try:
            fresh = load_config(self.config.config_file)
        except AgentConfigError as exc:
            log.error("SIGHUP: keeping the running configuration: %s", exc)
            return
        logging.getLogger("swim").setLevel(fresh.log_level.upper())
        # job registrations are runtime state, not configuration: a reload keeps them
        jobs = {k: v for k, v in self._tags.items() if k.startswith(TAG_PREFIX)}
        wanted = dict(fresh.tags) | jobs
        if wanted != self._tags:
            await self.set_tags(wanted)
        log.info("SIGHUP: reloaded tags and log level (%s)", fresh.log_level)

    # --- the API (agent.api.AgentAPI) ------------------------------------------------------

    async def set_tags(self, tags: dict[str, str]) -> dict[str, str]:
        return await self.update_tags(tags, (), replace=True)

    async def update_tags(
        self, set_: Mapping[str, str], delete: Iterable[str], *, replace: bool = False
    ) -> dict[str, str]:
        """Change tags atomically in the node task (concurrent callers cannot lose updates)."""
        driver, _ = self._parts()
        gone = list(delete)

        def run(now: int) -> dict[str, str]:
            tags = dict(set_) if replace else {**self._tags, **set_}
            for key in gone:
                tags.pop(key, None)
            meta = serf.encode_tags(tags)
            if len(meta) > MAX_META_BYTES:
                raise ValueError(f"tags would take {len(meta)} bytes; the limit is 512")
            if tags != self._tags:
                driver.apply(driver.node.set_meta(meta, now))
                self._tags = tags
                self.events.notify_changed()
            return tags

        result: dict[str, str] = await driver.command(run)
        return result

    async def probe_now(self, names: Sequence[str]) -> dict[str, Any]:
        """Probe these members at once (``Driver.probe_now``; the ``probe`` op)."""
        return await self._parts()[0].probe_now(names)

    async def snapshot(self) -> Snapshot:
        driver, serf_runtime = self._parts()

        def run(now: int) -> Snapshot:
            node = driver.node
            return Snapshot(
                name=node.name,
                address=node.address,
                incarnation=node.incarnation,
                health_score=node.health_score,
                encrypted=node.keyring is not None,
                profile=self.config.profile,
                tags=dict(self._tags),
                uptime_ms=now - self.started_ms,
                now_ms=now,
                members=serf_runtime.all_members(now),
                phi=self.phi.phi_all(now),
                stats={
                    **driver.stats(),
                    **(self.handlers.stats() if self.handlers else {}),
                    **(self.access.stats() if self.access else {}),
                    "key_file_warnings": len(self.key_file_warnings),
                },
                rtt_ms=dict(driver.probe_rtt_ms),
            )

        result: Snapshot = await driver.command(run)
        return result

    async def ping(self) -> int:
        result: int = await self.command(lambda t: t)
        return result

    async def live_members(self) -> list[Member]:
        driver, _ = self._parts()
        result: list[Member] = await driver.command(lambda t: driver.node.members())
        return result

    def all_members(self) -> list[Member]:
        """The members ``snapshot`` lists, read without the node task (tests): nothing is
        expired here, that happens in the node task."""
        return self._parts()[1].listed_members()

    def phi_values(self) -> dict[str, float]:
        return self.phi.phi_all(now_ms())

    async def force_leave(self, name: str) -> Member | None:
        _, serf_runtime = self._parts()
        result: Member | None = await self.command(lambda t: serf_runtime.force_leave(name, t))
        return result

    async def change_keys(self, action: str, key: str | None) -> tuple[list[bytes], bytes]:
        _, serf_runtime = self._parts()
        result: tuple[list[bytes], bytes] = await self.command(
            lambda t: serf_runtime.change_keys(action, key)
        )
        return result

    def subscribe(self, depth: int = 256) -> trio.MemoryReceiveChannel[dict[str, Any]]:
        return self.events.subscribe(depth)

    # --- joining --------------------------------------------------------------------------

    async def join(self, addresses: list[str]) -> dict[str, Any]:
        """Push-pull with each address (resolving names); counts the successes."""
        return await self._parts()[0].join(addresses)

    async def _retry_join(self) -> None:
        attempt = 0
        while self.config.retry_max == 0 or attempt < self.config.retry_max:
            attempt += 1
            result = await self.join(list(self.config.retry_join))
            if result["joined"]:
                log.info("retry-join: joined %d address(es)", result["joined"])
                return
            log.warning("retry-join attempt %d failed: %s", attempt, "; ".join(result["errors"]))
            await trio.sleep(self.config.retry_interval_ms / 1000)
        log.error("retry-join: giving up after %d attempts", attempt)

    async def _watchdog(self) -> None:
        interval = systemd.watchdog_interval_s()
        if interval is None:
            return
        while True:
            # The ping only goes out if the node task is responsive.
            await self.command(lambda t: None)
            systemd.notify("WATCHDOG=1")
            await trio.sleep(interval)


async def run_agent(
    config: AgentConfig,
    install_signals: bool = True,
    on_ready: Callable[[Agent], Awaitable[None]] | None = None,
) -> int:
    """Run until SIGTERM/SIGINT (graceful leave) or a leave request; SIGHUP reloads."""
    agent = Agent(config)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(agent.run)
            if on_ready is not None:
                await on_ready(agent)
            if install_signals:
                nursery.start_soon(_signals, agent)
            await agent.stopped.wait()
            nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # a start-up error (a port or socket in use, a group the agent cannot use) comes
        # wrapped in the nurseries' groups; raised alone, swimctl reports it in one line
        leaf: BaseException = group
        while isinstance(leaf, BaseExceptionGroup) and len(leaf.exceptions) == 1:
            leaf = leaf.exceptions[0]
        if not isinstance(leaf, (AgentConfigError, ControlError, OSError)):
            raise
        raise leaf from None
    return 0


async def _signals(agent: Agent) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async for signum in signals:
            if signum == signal.SIGHUP:
                await agent.reload()
            else:
                log.info("received %s: leaving the cluster", signal.Signals(signum).name)
                agent.request_shutdown()
