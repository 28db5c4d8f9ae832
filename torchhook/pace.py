"""Fail-slow detection in the loop: each rank times its own steps, the group shares the
figures once per window, and every rank applies ``torchhook.slowness`` to the same numbers.

What one step's figure is (milliseconds, ``time.perf_counter``): the time from the step's
start, just after its opening control all-reduce (every rank of the group leaves that
collective together, so the starts are aligned), to the step's end, minus the time this
rank spent waiting for its peers:

- every wait on a collective that the engine and the strategies do (``Group.wait``: HSDP's
  cross-node reduce, ``Elastic.all_reduce``), whole;
- DDP's gradient sync: the reducer waits for the gradient buckets inside autograd, where
  Python cannot time it, so that wait is taken as the time from the last bucket handed to
  the group (the backward pass is done) to the completion of the last bucket's
  all-reduce (the comm hook's Futures).

A fast rank's figure so leaves out the time it waited for a slow one; the slow rank's
keeps its own slowness. This needs no profiler and no GPU timer. The alternative, the
time to the first gradient collective, counts only the forward pass and the first bucket
of the backward, and misses a slow optimizer step or data loader. Where the figure is
blind: FSDP across nodes waits in its own all-gathers inside the forward (not timed here),
so every node looks as slow as the slowest and none is flagged (a miss, never a false
flag); on CUDA the host clock sees the GPU only where the host synchronizes with it.

Once every ``slow_window_steps`` steps, at a step boundary before the step function runs
(a failure there re-runs nothing), one all-gather of four numbers per rank: its window
figure (``slowness.window_figure``, the lower quartile of its step times; NaN without
one), its node's state (flagged, run) as this rank holds it, and (``replace``) the
number of spares its view shows. Every rank then judges with the same inputs (and the
same settings: ``slow_factor``, ``slow_windows`` and ``slow_quick_factor`` must agree
across the job). A flag set in one window by the quick rule leaves the same state
(flagged, run 0) as one set after ``slow_windows``, so the states carried in the next
all-gather mean the same whichever rule set them. A new group starts a new window (its
first step is left out: DDP builds its buckets there; no window ends at it); node states
carry over for the group's nodes. Local rank 0 of each node tells its agent when the
flagged set changes (``Membership.report_slow``: the agent's metric, ``job-slow`` event
and status page).

Policy ``exclude``: the excluded node's ranks close their registration (the node leaves
the job's view at once) and raise ``SlowNodeExcluded``: the node stops. The others wait
until their view drops it (at most ``EXCLUDE_WAIT_S``), then leave the group as after a
node loss and re-form without it. A node restarted later joins as a new member and is
judged again.

Policy ``replace`` (with ``target_nodes``): the same, but only while a spare is there to
take the slow node's place (``torchhook.roster`` fills its slot at the re-formation), and
for at most as many slow nodes as there are spares. The window's all-gather carries each
rank's count of spares in its view; the smallest count decides, so every rank reaches
the same verdict. With no spare, the node stays and is reported, as with ``report``. The
slow node leaves rather than waits as a spare: idle, it would not be measured, and the
next loss would draft it back while still slow.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from torchhook.client import Membership, MembershipClosed
from torchhook.errors import MembershipChanged, SlowNodeExcluded
from torchhook.parallel import Group
from torchhook.roster import spares_of
from torchhook.settings import Settings
from torchhook.slowness import NodeState, Verdict, judge, keep_at_least, window_figure

__all__ = ["EXCLUDE_WAIT_S", "Pace"]

log = logging.getLogger("torchhook.elastic")

EXCLUDE_WAIT_S = 10.0
"""How long the other nodes wait for their view to drop an excluded node before they
re-form anyway: it unregisters at once and its agent gossips that within a second or so;
a formation on a view that still lists it retries when the view changes."""
WAIT_SLICE_S = 0.5
"""Waits for a view are cut into slices with a heartbeat between them."""
SIBLING_GRACE_S = 1.0
"""A window's all-gather abandoned because this rank's own node left the view: how long
the rank still waits for the gather to complete. A sibling rank closes the node's
registration as soon as it has the window's table (it judged the node slow), which can
come before this rank's wait sees the same table; the table is there (every rank sent
its row), so it completes at once, and this rank reaches the same verdict and leaves
too instead of re-forming without its own node."""


class Pace:
    """One rank's step clock and its part in the fail-slow verdict."""

    def __init__(
        self,
        settings: Settings,
        membership: Membership,
        wait: Callable[[Any], None],
        beat: Callable[[], None],
    ) -> None:
        self.settings = settings
        self.membership = membership
        self.node = membership.node
        self._gather_wait = wait
        self._beat = beat
        self.enabled = settings.slow_policy != "off"
        self.states: dict[str, NodeState] = {}
        self.flagged: tuple[str, ...] = ()
        self.last_verdict: Verdict | None = None
        self.windows = 0
        self.last_figure_ms: float | None = None
        """This rank's figure in the last window (ms), None before one."""
        self._samples: deque[float] = deque(maxlen=settings.slow_window_steps)
        self._token = ""
        self._judged: tuple[str, int] = ("", -1)
        self._first = 0
        self._skip_first = True
        self._lock = threading.Lock()
        self._started: float | None = None
        self._waited = 0.0
        self._handed: float | None = None
        self._synced: float | None = None

    # --- the step clock ---------------------------------------------------------------

    @contextlib.contextmanager
    def step(self, group: Group, step: int) -> Iterator[None]:
        """Around one step's run: ``before_step``, then ``after_step`` if it returned."""
        self.before_step(group, step)
        try:
            yield
        except BaseException:
            with self._lock:
                self._started = None  # a failed step is no figure
            raise
        self.after_step()

    def before_step(self, group: Group, step: int) -> None:
        """At a step boundary: on a window's last boundary, share and judge; then start
        the step's clock. Raises ``SlowNodeExcluded`` (this node leaves) or
        ``MembershipChanged`` (another one does: re-form)."""
        if not self.enabled:
            return
        if group.token != self._token:
            self._token, self._skip_first, self._first = group.token, True, step
            self._samples.clear()
        n = self.settings.slow_window_steps
        # every rank of a group starts it at the same step: all of them judge, or none
        if step > self._first and step % n == 0 and self._judged != (group.token, step):
            self._judged = (group.token, step)
            self._window(group, step)
        with self._lock:
            self._started = time.perf_counter()
            self._waited = 0.0
            self._handed = self._synced = None

    def after_step(self) -> None:
        """The step returned: keep its figure (the first step of a group is left out)."""
        with self._lock:
            started, self._started = self._started, None
            if started is None:
                return
            wall = time.perf_counter() - started
            ddp = 0.0
            if self._handed is not None and self._synced is not None:
                ddp = max(self._synced - self._handed, 0.0)
            figure_ms = max(wall - self._waited - ddp, 0.0) * 1000
        if self._skip_first:
            self._skip_first = False
            return
        self._samples.append(figure_ms)

    @property
    def figure_ms(self) -> float | None:
        """This rank's step compute time now (ms): its figure over the window so far, else
        the last window's figure."""
        return window_figure(self._samples) or self.last_figure_ms

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Around a wait for peers: inside a step, its time is not this rank's compute."""
        begun = time.perf_counter()
        try:
            yield
        finally:
            with self._lock:
                if self._started is not None:
                    self._waited += time.perf_counter() - begun

    def bucket(self, fut: torch.futures.Future[torch.Tensor]) -> torch.futures.Future[torch.Tensor]:
        """DDP's comm hook Future for one bucket: note when it was handed and done."""
        with self._lock:
            self._handed = time.perf_counter()

        def done(_: torch.futures.Future[torch.Tensor]) -> None:
            with self._lock:
                self._synced = time.perf_counter()

        fut.add_done_callback(done)
        return fut

    # --- the window -------------------------------------------------------------------

    def _window(self, group: Group, step: int) -> None:
        enough = max(1, self.settings.slow_window_steps // 2)
        figure = window_figure(self._samples) if len(self._samples) >= enough else None
        self.last_figure_ms = figure if figure is not None else self.last_figure_ms
        self._samples.clear()
        mine = self.states.get(self.node, NodeState())
        spares = 0.0
        if self.settings.slow_policy == "replace":  # a spare this rank's view shows
            spares = float(len(spares_of(group.layout, self.membership.view.members)))
        row = [
            figure if figure is not None else math.nan,
            float(mine.flagged),
            float(mine.run),
            spares,
        ]
        sent = torch.tensor(row, dtype=torch.float64, device=group.device)
        rows = [torch.empty_like(sent) for _ in range(group.world_size)]
        work = dist.all_gather(rows, sent, async_op=True)
        try:
            self._gather_wait(work)
        except MembershipChanged:
            if self.node in self.membership.view or not _completes(work, SIBLING_GRACE_S):
                raise  # a peer lost: the re-formation it starts must not wait
        table = [r.cpu().tolist() for r in rows]
        figures: dict[str, float | None] = {}
        states: dict[str, NodeState] = {}
        for node in group.layout.nodes:
            ranks = group.layout.ranks_of(node.name)
            values = [table[r][0] for r in ranks if not math.isnan(table[r][0])]
            figures[node.name] = max(values) if len(values) == len(ranks) else None
            first = table[ranks[0]]
            states[node.name] = NodeState(bool(first[1]), int(first[2]))
        s = self.settings
        keep = keep_at_least(len(figures), s.min_nodes, s.quorum == "majority")
        verdict = judge(
            figures,
            states,
            factor=s.slow_factor,
            windows=s.slow_windows,
            keep=keep,
            quick_factor=s.slow_quick_factor,
        )
        self.windows += 1
        log.debug("window at step %d: figures %s, flagged %s", step, figures, verdict.flagged)
        self.last_verdict = verdict
        self.states = verdict.states
        self._report(verdict, group)
        if s.slow_policy == "exclude" and verdict.exclude:
            self._exclude(verdict, verdict.exclude)
        # replace: as many as every rank sees spares for (the same table: the same verdict)
        swaps = int(min(r[3] for r in table)) if s.slow_policy == "replace" else 0
        if swaps and verdict.exclude:
            self._exclude(verdict, verdict.exclude[:swaps])

    def _report(self, verdict: Verdict, group: Group) -> None:
        if verdict.flagged == self.flagged:
            return
        self.flagged = verdict.flagged
        ratios = {n: round(verdict.ratios.get(n, 0.0), 3) for n in verdict.flagged}
        if group.local_rank != 0:
            return
        for name in verdict.newly:
            log.warning(
                "node %s flagged slow: %.2fx the median step time (%.1f ms), %d windows",
                name,
                verdict.ratios.get(name, math.nan),
                verdict.reference_ms or math.nan,
                1 if name in verdict.quick else self.settings.slow_windows,
            )
        for name in verdict.cleared:
            log.info("node %s no longer slow", name)
        with contextlib.suppress(MembershipClosed):
            self.membership.report_slow(ratios)

    def _exclude(self, verdict: Verdict, gone: tuple[str, ...]) -> None:
        policy = self.settings.slow_policy
        if self.node in gone:
            log.error("this node is slow: leaving the job (slow_policy=%r)", policy)
            self.membership.close()  # unregisters: the node leaves the view at once
            raise SlowNodeExcluded(
                f"node {self.node} was flagged slow "
                f"({verdict.ratios.get(self.node, math.nan):.2f}x the median step time) "
                f"and left the job (slow_policy={policy!r})"
            )
        deadline = time.monotonic() + EXCLUDE_WAIT_S
        while (left := deadline - time.monotonic()) > 0:
            try:
                self.membership.wait(
                    lambda v: not any(n in v for n in gone), min(left, WAIT_SLICE_S)
                )
                break
            except TimeoutError:
                self._beat()
        raise MembershipChanged(f"slow node(s) {list(gone)} left (slow_policy={policy!r})")


def _completes(work: Any, seconds: float) -> bool:
    """Whether collective ``work`` completes, without error, within ``seconds`` (polled;
    no heartbeat needed for a wait this short)."""
    deadline = time.monotonic() + seconds
    while not work.is_completed():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)
    try:
        work.wait()
    except RuntimeError:  # the group failed under it: no table
        return False
    return True
