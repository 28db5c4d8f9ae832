"""Random generator state that travels with the training state (``torchhook.state``).

:class:`RngCarry` says which generators travel and captures, checks and loads their state:

- the torch CPU generator, always (``torch.get_rng_state``: the global generator behind
  ``torch.rand``, dropout on CPU, and the seed a ``DataLoader`` gives its workers);
- CUDA generators when CUDA is available, one per listed device (``cuda_devices``, default
  the current device, since each rank usually drives one GPU and touching every device would
  create a context on each). States travel by position: the k-th captured state goes to the
  receiver's k-th listed device, because ranks of one node use different device indices;
- Python's ``random`` and numpy's global generator only when asked (many jobs never draw
  from them; loading them replaces state that other libraries may rely on).

Not carried: per-worker RNG of DataLoader workers (workers are seeded from the torch CPU
generator when an iterator starts), ``torch.Generator`` objects the user creates, and
numpy ``Generator`` objects (``default_rng``): register those with ``torchhook.state``.

States are plain: uint8 tensors for torch and CUDA (their own format), Python's state as
``random.getstate()`` gives it (a tuple of ints), numpy's MT19937 key as an int64 tensor, so
that ``torch.load(weights_only=True)`` reads them. Every check runs before any load.
Public precedent: ``torch.random.fork_rng`` (per-device CUDA state) and torchtitan's
checkpointed RNG.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

_PYTHON_STATE_LEN = 625  # random.getstate()[1]: 624 MT19937 words and the position
_NUMPY_KEY_LEN = 624  # MT19937's key
KINDS = ("torch", "cuda", "python", "numpy")


class RngStateError(ValueError):
    """RNG state that this carry cannot load; the message says which generator and why."""


class RngCarry:
    """Which generators travel (module docstring); ``cuda_devices=None``: the current
    device when CUDA is available, else none (decided at each call)."""

    def __init__(
        self,
        *,
        python_random: bool = False,
        numpy_random: bool = False,
        cuda_devices: Sequence[int] | None = None,
    ) -> None:
        self.python_random = bool(python_random)
        self.numpy_random = bool(numpy_random)
        self._cuda_devices = None if cuda_devices is None else tuple(cuda_devices)
        if self._cuda_devices is not None and not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in self._cuda_devices
        ):
            raise ValueError(f"cuda_devices must be device indices, got {cuda_devices!r}")

    def devices(self) -> tuple[int, ...]:
        if self._cuda_devices is not None:
            return self._cuda_devices
        return (torch.cuda.current_device(),) if torch.cuda.is_available() else ()

    def kinds(self) -> set[str]:
        on = {"torch": True, "cuda": bool(self.devices())}
        on |= {"python": self.python_random, "numpy": self.numpy_random}
        return {kind for kind, carried in on.items() if carried}

    def capture(self) -> dict[str, Any]:
        rng: dict[str, Any] = {"torch": torch.get_rng_state()}
        devices = self.devices()
        if devices:
            rng["cuda"] = [torch.cuda.get_rng_state(d) for d in devices]
        if self.python_random:
            rng["python"] = random.getstate()
        if self.numpy_random:
            state = np.random.get_state(legacy=False)
            rng["numpy"] = {
                "key": torch.from_numpy(state["state"]["key"].astype(np.int64)),
                "pos": int(state["state"]["pos"]),
                "has_gauss": int(state["has_gauss"]),
                "gauss": float(state["gauss"]),
            }
        return rng

    def check(self, rng: object) -> None:
        """Raise :class:`RngStateError` unless ``rng`` holds exactly the carried kinds, each
        of the right type and size for this process's generators."""
        wanted = self.kinds()
        if not isinstance(rng, dict) or set(rng) != wanted:
            got = sorted(rng) if isinstance(rng, dict) else type(rng).__name__
            raise RngStateError(f"the state carries RNG {got}, this process {sorted(wanted)}")
        _byte_state("torch RNG", rng["torch"], torch.get_rng_state().numel())
        devices = self.devices()
        if devices:
            states = rng["cuda"]
            if not isinstance(states, list) or len(states) != len(devices):
                count = len(states) if isinstance(states, list) else type(states).__name__
                raise RngStateError(f"CUDA RNG for {count} devices, this process {devices}")
            for i, (state, device) in enumerate(zip(states, devices, strict=True)):
                _byte_state(f"CUDA RNG {i}", state, torch.cuda.get_rng_state(device).numel())
        if self.python_random:
            _check_python(rng["python"])
        if self.numpy_random:
            _check_numpy(rng["numpy"])

    def load(self, rng: dict[str, Any]) -> None:
        """Load a state that :meth:`check` passed."""
        torch.set_rng_state(rng["torch"])
        for state, device in zip(rng.get("cuda", ()), self.devices(), strict=True):
            torch.cuda.set_rng_state(state, device)
        if "python" in rng:
            version, words, gauss = rng["python"]
            random.setstate((version, tuple(words), gauss))
        if "numpy" in rng:
            n = rng["numpy"]
            key = n["key"].numpy().astype(np.uint32)
            np.random.set_state(("MT19937", key, n["pos"], n["has_gauss"], n["gauss"]))


def _byte_state(what: str, value: object, size: int) -> None:
    if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8 or value.dim() != 1:
        raise RngStateError(f"{what} state is not a 1-D uint8 tensor: {type(value).__name__}")
    if value.numel() != size:
        raise RngStateError(f"{what} state has {value.numel()} bytes, this generator {size}")


def _is_int(value: object, low: int, high: int) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and low <= value <= high


def _check_python(state: object) -> None:
    if not (isinstance(state, tuple) and len(state) == 3 and state[0] == 3):
        raise RngStateError("Python random state is not (3, words, gauss)")
    words, gauss = state[1], state[2]
    if not (isinstance(words, tuple) and len(words) == _PYTHON_STATE_LEN):
        raise RngStateError(f"Python random state does not hold {_PYTHON_STATE_LEN} words")
    if not all(_is_int(w, 0, 0xFFFFFFFF) for w in words[:-1]) or not _is_int(words[-1], 0, 624):
        raise RngStateError("Python random state holds words out of range")
    if gauss is not None and not isinstance(gauss, float):
        raise RngStateError("Python random state's gauss is not a float or None")


def _check_numpy(state: object) -> None:
    if not isinstance(state, dict) or set(state) != {"key", "pos", "has_gauss", "gauss"}:
        raise RngStateError("numpy RNG state is not a mapping of key, pos, has_gauss, gauss")
    key = state["key"]
    if not (
        isinstance(key, torch.Tensor)
        and key.dtype == torch.int64
        and key.shape == (_NUMPY_KEY_LEN,)
        and bool(((key >= 0) & (key <= 0xFFFFFFFF)).all())
    ):
        raise RngStateError(f"numpy RNG key is not {_NUMPY_KEY_LEN} 32-bit words")
    if not _is_int(state["pos"], 0, _NUMPY_KEY_LEN) or not _is_int(state["has_gauss"], 0, 1):
        raise RngStateError("numpy RNG pos or has_gauss out of range")
    if not isinstance(state["gauss"], float):
        raise RngStateError("numpy RNG gauss is not a float")
