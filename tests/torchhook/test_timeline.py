"""The re-formation timeline (torchhook.timeline): pure, on an injected clock."""

from __future__ import annotations

from torchhook.timeline import MAX_MARKS, Timeline


def clock_from(times: list[float]) -> Timeline:
    ticks = iter(times)
    return Timeline(lambda: next(ticks))


def test_marks_run_from_leaving_to_the_first_completed_step() -> None:
    tl = clock_from([1.0, 1.5, 1.7, 2.0])
    tl.mark("agreed")  # no re-formation open: nothing recorded, no clock read
    tl.open("left")
    tl.mark("agreed")
    tl.open("left")  # a second failure inside the same re-formation: ignored
    tl.mark("agreed")  # the first time a phase was reached is kept
    tl.mark("group")
    assert tl.last == {}, "published only when a step completes"
    tl.close()
    assert tl.last == {"left": 1.0, "agreed": 1.5, "group": 1.7, "step": 2.0}
    tl.mark("fn")  # between re-formations: a no-op
    tl.close()
    assert tl.last == {"left": 1.0, "agreed": 1.5, "group": 1.7, "step": 2.0}


def test_marks_per_re_formation_are_bounded() -> None:
    tl = Timeline(lambda: 0.0)
    tl.open("left")
    for i in range(3 * MAX_MARKS):
        tl.mark(f"phase{i}")
    tl.close()
    assert len(tl.last) == MAX_MARKS, "the step mark is dropped too once the bound is hit"
