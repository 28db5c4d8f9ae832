"""Fixtures shared by the network-namespace tests: skip with the reason where namespaces
cannot be made, and a ``testbed`` factory that tears down everything it built."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.netns import harness
from tests.netns.harness import Testbeds


@pytest.fixture(scope="module", autouse=True)
def _netns_guard() -> None:
    reason = harness.unavailable_reason()
    if reason:
        pytest.skip(reason)


@pytest.fixture
def testbed(tmp_path: Path) -> Iterator[Testbeds]:
    with harness.testbeds(tmp_path) as make:
        yield make
