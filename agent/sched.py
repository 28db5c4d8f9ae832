"""The agent's CPU scheduling: a short scheduler slice, so it runs soon after it wakes.

Why: on a GPU node the training job's data loaders can keep hundreds of threads runnable.
Linux (6.6 and later) schedules normal threads with EEVDF, earliest eligible virtual
deadline first: a thread that wakes (the agent, for a ping) is placed among the runnable
ones with a virtual deadline of about its slice divided by its weight, so with the default
slice (0.7-3 ms, scaled with the core count) it queues behind a share of every runnable
thread of its cgroup at the same priority: hundreds of milliseconds when 300 threads
share two cores (bench/starved_host.py), which to a ``fast`` cluster is a dead member. Since
Linux 6.12 a thread may ask for a shorter slice (``sched_setattr``, ``sched_runtime`` of a
``SCHED_OTHER`` thread, 0.1-100 ms, no privilege needed: it changes *when* the thread runs,
not how much): a waking thread with a short slice gets an early deadline and may preempt
the running one at once (the kernel's ``PREEMPT_SHORT``). The agent runs for well under a
millisecond per wake-up, so a 100 µs slice costs it nothing and the job nothing.

Rules:
- ``request_slice`` asks for ``slice_us`` for the calling thread (the trio thread: it reads
  the socket, runs the protocol and answers pings; threads started later by the agent keep
  the default). Best effort: where the call is missing or refused (not Linux, a kernel older
  than 6.12 takes ``sched_runtime`` but ignores it for normal threads, ``ENOSYS``, a seccomp
  filter's ``EPERM``: the systemd unit allows ``sched_setattr`` explicitly), it returns why,
  and the agent logs it once and runs with the default.
- Only the slice changes: the policy stays ``SCHED_OTHER`` and the nice value is kept (read
  first with ``sched_getattr``), so ``Nice=`` from the unit still applies.
- ``MIN_SLICE_US``..``MAX_SLICE_US`` is the kernel's own range; 0 leaves the default.

Source: the Linux kernel's ``sched_setattr(2)`` and Documentation/scheduler/sched-eevdf.rst
(custom slices).
"""

from __future__ import annotations

import ctypes
import os
import platform
import struct

__all__ = ["DEFAULT_SLICE_US", "MAX_SLICE_US", "MIN_SLICE_US", "request_slice", "slice_us"]

DEFAULT_SLICE_US = 100
"""The agent's slice: the kernel's shortest (a wake-up's work is a fraction of it)."""
MIN_SLICE_US = 100
MAX_SLICE_US = 100_000
"""The kernel clamps a custom slice to 0.1-100 ms."""

_SYSCALLS = {"x86_64": (314, 315), "aarch64": (274, 275)}
"""(sched_setattr, sched_getattr) by machine; elsewhere the slice is left alone."""
_ATTR = struct.Struct("IIQiIQQQII")  # struct sched_attr, SCHED_ATTR_SIZE_VER1 (56 bytes)


def _syscalls() -> tuple[int, int] | None:
    if platform.system() != "Linux":
        return None
    return _SYSCALLS.get(platform.machine())


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _getattr(tid: int) -> tuple[int, ...]:
    nums = _syscalls()
    if nums is None:
        raise OSError(f"sched_getattr is not known on {platform.system()} {platform.machine()}")
    buf = ctypes.create_string_buffer(_ATTR.size)
    if _libc().syscall(nums[1], tid, buf, _ATTR.size, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"sched_getattr: {os.strerror(err)}")
    return _ATTR.unpack(buf.raw)


def slice_us(tid: int = 0) -> int:
    """The thread's current slice in µs (0: the calling thread). Raises OSError."""
    return int(_getattr(tid)[5]) // 1000


def request_slice(us: int, tid: int = 0) -> str | None:
    """Ask for a slice of ``us`` µs for thread ``tid`` (0: the calling one; 0 µs: back to
    the default). None if done, else why not (the agent logs it and carries on)."""
    if us != 0 and not MIN_SLICE_US <= us <= MAX_SLICE_US:
        raise ValueError(f"slice must be 0 or {MIN_SLICE_US}..{MAX_SLICE_US} µs, got {us}")
    nums = _syscalls()
    if nums is None:
        return f"no sched_setattr on {platform.system()} {platform.machine()}"
    try:
        current = _getattr(tid)
    except OSError as exc:
        return str(exc)
    policy, nice = current[1], current[3]
    if policy != 0:  # SCHED_OTHER only: a batch, idle or real-time policy is left as set
        return f"scheduling policy {policy} is not SCHED_OTHER; slice left alone"
    attr = _ATTR.pack(_ATTR.size, 0, 0, nice, 0, us * 1000, 0, 0, 0, 0)
    buf = ctypes.create_string_buffer(attr, _ATTR.size)
    if _libc().syscall(nums[0], tid, buf, 0) != 0:
        err = ctypes.get_errno()
        return f"sched_setattr: {os.strerror(err)}"
    try:
        got = slice_us(tid)
    except OSError as exc:
        return str(exc)
    if us and got != us:  # before 6.12 the call succeeds and the slice stays the default
        return f"this kernel keeps its default slice ({got} µs; custom slices: Linux 6.12+)"
    return None
