"""Run a test module's long scenarios at the same time, each with its own processes.

Why: most of the wall time of a scenario that starts real agents is a window in which the
box is nearly idle: a fault held for 25-60 s while agents using ~1 % of a core each are
watched. Run one after another, a module's windows add up; run together, the module takes
about as long as its longest scenario plus the bring-ups before it.

How: the module defines ``SCENARIOS`` (test name, as pytest names the item, e.g.
``test_x[0.1]`` -> a function of ``(workdir, gate)`` holding the test's old body) and a
module-scoped fixture returning ``run_together(request, SCENARIOS, tmp_dir)``. That looks
up which of the module's tests that use the fixture were selected (``-k`` and node ids are
honoured: a scenario runs only if its test does), starts each selected scenario in a thread
of its own with its own work directory (``s<i>``), in ``SCENARIOS`` order (longest first), and waits
for all of them. Each test then calls ``together.check(request)``, which re-raises its own
scenario's failure with the scenario's traceback: every test still passes, fails or skips
on its own assertions.

What stays the same: each scenario's hosts, profile, windows, faults and assertions. What
changes: other scenarios' agents run beside it, mostly idle. A scenario brings its agents
up inside ``gate`` (one bring-up at a time: starting Python agents is the CPU-heavy moment,
and the ``wait_ready``/``wait_converged`` bounds were set for one bring-up at a time); its
fault window then overlaps other scenarios' windows and their bring-ups.

Bounds: at most ``MAX_SCENARIOS`` threads per module; each scenario ends by its own
deadlines (every wait in it has a timeout), and the fixture waits at most ``JOIN_BOUND_S``
for all of them (below pytest-timeout's 300 s), then fails the scenarios still running.
The threads are not daemons: a scenario still running past the bound goes on to its own
end, which removes what it started (its ``with`` blocks close its testbeds and
processes), and the interpreter waits for it at exit. A daemon thread would be frozen at
exit, after the atexit cleanup, and could leave a namespace it was creating behind.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest

MAX_SCENARIOS = 12  # a module's scenarios; each holds a few agents, mostly idle
JOIN_BOUND_S = 240.0  # all scenarios of a module; pytest-timeout ends an item at 300 s
START_SPACING_S = 0.05  # so the scenarios queue at the gate in SCENARIOS order

Scenario = Callable[[Path, threading.Lock], None]


class Together:
    """The outcome of each scenario that ran: None (passed) or what it raised."""

    def __init__(self, outcomes: dict[str, BaseException | None], seconds: dict[str, float]):
        self.outcomes = outcomes
        self.seconds = seconds  # wall time of each scenario, bring-up wait included

    def check(self, request: pytest.FixtureRequest) -> None:
        """Re-raise the failure (or skip) of the requesting test's scenario, if any."""
        name = request.node.name
        if name not in self.outcomes:
            raise LookupError(f"{name} did not run: it has no entry in the module's SCENARIOS")
        print(f"\n{name}: scenario took {self.seconds.get(name, float('nan')):.1f} s")
        outcome = self.outcomes[name]
        if outcome is not None:
            raise outcome


def selected(request: pytest.FixtureRequest) -> list[str]:
    """Names of the selected tests of the requesting module that use the same fixture."""
    fixture = request.fixturename
    return [
        item.name
        for item in request.session.items
        if getattr(item, "module", None) is request.module
        and fixture in getattr(item, "fixturenames", ())
    ]


def run_together(
    request: pytest.FixtureRequest, scenarios: Mapping[str, Scenario], tmp_dir: Path
) -> Together:
    """Run the scenarios of the selected tests at once (see the module docstring)."""
    wanted = selected(request)
    unknown = sorted(set(wanted) - set(scenarios))
    if unknown:
        raise LookupError(f"tests without a scenario in SCENARIOS: {unknown}")
    order = [name for name in scenarios if name in wanted]
    if len(order) > MAX_SCENARIOS:
        raise ValueError(f"{len(order)} scenarios at once; at most {MAX_SCENARIOS}")
    gate = threading.Lock()
    outcomes: dict[str, BaseException | None] = {}
    seconds: dict[str, float] = {}

    def run(name: str, workdir: Path) -> None:
        start = time.monotonic()
        try:
            scenarios[name](workdir, gate)
            outcomes[name] = None
        except BaseException as exc:  # handed to the scenario's own test
            outcomes[name] = exc
        finally:
            seconds[name] = time.monotonic() - start

    threads: list[threading.Thread] = []
    for i, name in enumerate(order):
        workdir = tmp_dir / f"s{i}"  # short: a control socket's path has a 108-byte limit
        workdir.mkdir(parents=True, exist_ok=True)
        t = threading.Thread(target=run, args=(name, workdir), name=name)
        t.start()
        threads.append(t)
        time.sleep(START_SPACING_S)
    deadline = time.monotonic() + JOIN_BOUND_S
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    for name, t in zip(order, threads, strict=True):
        if t.is_alive():
            outcomes[name] = TimeoutError(
                f"{name}: still running {JOIN_BOUND_S:g} s after the scenarios started"
            )
    return Together(outcomes, seconds)
