"""What a worker process of a multi-process gloo test does around its body: its stderr to
a file under the test's directory (pytest shows it when the test fails), an exception
printed there and turned into exit status 3, and ``os._exit`` at the end (a worker that
holds gloo groups must not run the interpreter's normal exit, which could wait on an op
left in them)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import NoReturn

__all__ = ["FAILED", "run_worker"]

FAILED = 3
"""A worker's exit status when its body raised."""


def run_worker(body: Callable[[int, int, str], object], rank: int, port: int, out: str) -> NoReturn:
    err = os.open(f"{out}/{rank}.err", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(err, 2)
    code = 0
    try:
        body(rank, port, out)
    except Exception as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        code = FAILED
    os._exit(code)
