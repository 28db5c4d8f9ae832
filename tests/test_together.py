"""tests/together.py: the selected tests' scenarios run at once, only those, one bring-up at
a time, and each test passes or fails on its own scenario (a real pytest run of a small
module, pytester)."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

MODULE = """
import functools
import threading
import time

import pytest

from tests.together import run_together

LOG = []
INSIDE = []


def scenario(workdir, gate, name, fail=False):
    with gate:
        INSIDE.append(name)
        assert len(INSIDE) == 1, INSIDE  # nobody else inside the gate
        time.sleep(0.05)
        INSIDE.remove(name)
    LOG.append(("start", name, time.monotonic()))
    time.sleep(0.5)
    LOG.append(("end", name, time.monotonic()))
    assert workdir.is_dir()
    assert not fail, f"{name} failed on its own"


SCENARIOS = {
    "test_a": functools.partial(scenario, name="a"),
    "test_p[1]": functools.partial(scenario, name="p1"),
    "test_p[2]": functools.partial(scenario, name="p2", fail=True),
}


@pytest.fixture(scope="module")
def together(request, tmp_path_factory):
    return run_together(request, SCENARIOS, tmp_path_factory.mktemp("t"))


def test_a(together, request):
    together.check(request)


@pytest.mark.parametrize("n", [1, 2])
def test_p(together, request, n):
    together.check(request)


def test_overlap():
    starts = [t for kind, _, t in LOG if kind == "start"]
    ends = [t for kind, _, t in LOG if kind == "end"]
    print("RAN", sorted(name for kind, name, _ in LOG if kind == "end"))
    if len(starts) > 1:
        assert max(starts) < min(ends), LOG  # the windows overlapped
"""


@pytest.fixture
def module(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makepyfile(test_mod=MODULE)
    pytester.syspathinsert(str(pytest.importorskip("tests").__path__[0].rsplit("/", 1)[0]))
    return pytester


def test_each_test_gets_its_own_scenarios_outcome(module: pytest.Pytester) -> None:
    result = module.runpytest_inprocess("-s", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.re_match_lines([r".*p2 failed on its own"])
    result.stdout.re_match_lines([r".*RAN \['a', 'p1', 'p2'\]"])


def test_only_the_selected_scenarios_run(module: pytest.Pytester) -> None:
    result = module.runpytest_inprocess(
        "-s", "-p", "no:cacheprovider", "-k", "test_a or p and 1 or overlap"
    )
    result.assert_outcomes(passed=3, deselected=1)
    result.stdout.re_match_lines([r".*RAN \['a', 'p1'\]"])
