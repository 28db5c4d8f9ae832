"""The training state that travels with the model across a world change, beyond parameters
and optimizer state: registered user objects, RNG state, and the world-change callback.

What travels (one snapshot, taken on the source rank, loaded on every other rank):

- **Registered objects**: anything with ``state_dict()`` and ``load_state_dict(state)``
  (torch.distributed.checkpoint's ``Stateful`` protocol), under a unique name: an LR
  scheduler, ``torchhook.data.ElasticSampler`` (its position in the sample stream), a
  ``StatefulDataLoader``, the user's counters. Names are checked when registered, and an
  object without the two methods is refused with a ``TypeError`` naming it.
- **Schedulers across a new optimizer**: the engine builds a new optimizer for each new
  group, and a scheduler holds its optimizer. :class:`Rebuilt` holds a factory
  (``lambda opt: LambdaLR(opt, ...)``); on :meth:`TrainingState.rebind` it builds a fresh
  scheduler over the new optimizer and loads the old one's ``state_dict`` into it, together
  with the optimizer's per-group hyperparameters (``lr``, ``initial_lr``, momentum/betas that
  ``OneCycleLR`` cycles): a new scheduler's constructor steps once and overwrites ``lr``, so
  the scheduler's ``state_dict`` alone does not give back the learning rate in use.
- **RNG**: the torch CPU generator always, the CUDA generators of this rank's devices when
  CUDA is available, Python's ``random`` and numpy's global generator only if asked
  (``torchhook.rng``). Every receiver gets the *source's* RNG: a job that seeds ranks
  differently (per-rank dropout) reseeds in its ``on_reset`` callback.
- **Not carried**: the model and optimizer (the strategy moves those as tensors), the RNG
  of DataLoader worker processes (seeded from the torch CPU generator when an iterator
  starts, so a new iterator after the change is seeded from the carried state),
  ``torch.Generator`` objects the user creates (register a wrapper if they matter), and any
  other global state.

Validate, then mutate: :meth:`TrainingState.restore` checks the whole snapshot first (every
registered name present, none unknown, each entry of the right type, RNG states of the
right kind, size and count) and raises :class:`SnapshotError` naming what is wrong before
anything is loaded. An object that refuses its state in its own ``load_state_dict`` makes
the objects loaded before it roll back to their previous state, and the error names it.

On the wire: ``torchhook.state_wire`` encodes a snapshot (``torch.save``, loaded with
``weights_only=True``) and broadcasts it from a source rank.

The ``on_reset`` contract: after each reconfiguration the engine calls every registered
callback as ``callback(old, new)`` with two :class:`World` records, on every rank, after
the state is restored and before the next step, in registration order. An exception from a
callback is the user's and is fatal: it comes out as :class:`ResetCallbackError` (the
original as ``__cause__``), which the engine does not retry.

Public precedent: torch.distributed.checkpoint's ``Stateful`` protocol and torchtitan's
``TrainState``/``CheckpointManager`` (named ``Stateful`` objects saved with the model);
``torch.random.fork_rng`` for the per-device CUDA RNG.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypedDict, TypeVar, runtime_checkable

import torch
from torch.optim import Optimizer

from torchhook.rng import KINDS, RngCarry, RngStateError

MAX_OBJECTS = 256
"""Registered objects (and, separately, ``on_reset`` callbacks) per state: a registry is a
handful of names (scheduler, sampler, counters); the bound catches a registration in a loop."""

MAX_NAME_CHARS = 128
"""Characters in a registered name: names appear in every error message about the state."""

SNAPSHOT_VERSION = 1
_NOT_HYPERPARAMETERS = ("params", "param_names")


class SnapshotError(ValueError):
    """A snapshot that this state cannot load (or encode, or decode); the message says what."""


class ResetCallbackError(RuntimeError):
    """An ``on_reset`` callback raised: the user's error, fatal (the original is the cause)."""


@runtime_checkable
class Stateful(Protocol):
    """torch.distributed.checkpoint's ``Stateful``: what a registered object must offer."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> Any: ...


class Snapshot(TypedDict):
    """A captured state: plain containers and tensors only (``weights_only``-loadable)."""

    version: int
    objects: dict[str, Any]
    rng: dict[str, Any]


@dataclass(frozen=True)
class World:
    """One world as ``on_reset`` sees it: this rank's place in it and the node names in rank
    order. ``step``: the committed steps when the old world ended or the new one begins
    (lower in the new one only when the strategy rolled back to a checkpoint)."""

    world_size: int
    rank: int
    nodes: tuple[str, ...]
    step: int

    def __post_init__(self) -> None:
        for name, value, low in (("world_size", self.world_size, 1), ("step", self.step, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"World.{name} must be an integer >= {low}, got {value!r}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int):
            raise ValueError(f"World.rank must be an integer, got {self.rank!r}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"World.rank must be in 0..{self.world_size - 1}, got {self.rank}")
        if not isinstance(self.nodes, tuple) or not all(
            isinstance(n, str) and n for n in self.nodes
        ):
            raise ValueError(f"World.nodes must be a tuple of node names, got {self.nodes!r}")
        if not 1 <= len(self.nodes) <= self.world_size:
            raise ValueError(
                f"World.nodes names {len(self.nodes)} nodes for {self.world_size} ranks"
            )


OnReset = Callable[[World, World], None]
"""``callback(old, new)`` after a reconfiguration (module docstring: the contract)."""

S = TypeVar("S", bound=Stateful)


def _hyperparameters(optimizer: Optimizer) -> list[dict[str, Any]]:
    return [
        {k: copy.deepcopy(v) for k, v in g.items() if k not in _NOT_HYPERPARAMETERS}
        for g in optimizer.param_groups
    ]


class Rebuilt(Generic[S]):
    """A scheduler (or anything bound to one optimizer) that survives a new optimizer.

    ``factory(optimizer)`` builds it; :meth:`rebind` builds a fresh one over a new optimizer
    and loads the old one's state and the old optimizer's per-group hyperparameters into it.
    Step it (:meth:`step`) or ``current``: a reference kept to an older object stays bound
    to the old optimizer.
    Its state (registered like any object) is ``{"scheduler": ..., "param_groups": [...]}``."""

    def __init__(self, factory: Callable[[Optimizer], S], optimizer: Optimizer) -> None:
        self._factory = factory
        self._optimizer = optimizer
        self._current = self._build(optimizer)

    def _build(self, optimizer: Optimizer) -> S:
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"Rebuilt needs a torch.optim.Optimizer, got {type(optimizer)}")
        built = self._factory(optimizer)
        _check_stateful("the factory's result", built)
        return built

    @property
    def current(self) -> S:
        return self._current

    @property
    def optimizer(self) -> Optimizer:
        return self._optimizer

    def step(self, *args: Any, **kwargs: Any) -> Any:
        """``current.step(...)`` (``ReduceLROnPlateau`` takes the metric)."""
        return getattr(self._current, "step")(*args, **kwargs)  # noqa: B009 (S has no step)

    def state_dict(self) -> dict[str, Any]:
        return {
            "scheduler": self._current.state_dict(),
            "param_groups": _hyperparameters(self._optimizer),
        }

    def check(self, state: object) -> None:
        """Raise :class:`SnapshotError` unless ``state`` fits the current optimizer."""
        if not isinstance(state, Mapping) or set(state) != {"scheduler", "param_groups"}:
            raise SnapshotError("a Rebuilt state is a mapping of 'scheduler' and 'param_groups'")
        if not isinstance(state["scheduler"], Mapping):
            raise SnapshotError("a Rebuilt state's 'scheduler' is not a mapping")
        groups = state["param_groups"]
        if not isinstance(groups, list) or not all(
            isinstance(g, Mapping) and all(isinstance(k, str) for k in g) for g in groups
        ):
            raise SnapshotError("a Rebuilt state's 'param_groups' is not a list of mappings")
        if len(groups) != len(self._optimizer.param_groups):
            raise SnapshotError(
                f"the state has {len(groups)} parameter groups, the optimizer "
                f"{len(self._optimizer.param_groups)}"
            )

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Validates first (:meth:`check`), then loads the scheduler and writes the
        hyperparameters into the optimizer's groups (a tensor ``lr`` is set in place)."""
        self.check(state)
        _load(self._current, self._optimizer, state)

    def rebind(self, optimizer: Optimizer) -> None:
        """Build a fresh object over ``optimizer`` carrying the old one's state. The factory
        runs and the state loads into the fresh object before it replaces the old one: if
        either raises, or the new optimizer has another number of parameter groups
        (:class:`SnapshotError`), this object keeps its old scheduler and optimizer."""
        state = self.state_dict()
        if len(optimizer.param_groups) != len(self._optimizer.param_groups):
            raise SnapshotError(
                f"the new optimizer has {len(optimizer.param_groups)} parameter groups, "
                f"the old one {len(self._optimizer.param_groups)}"
            )
        built = self._build(optimizer)
        _load(built, optimizer, state)
        self._current, self._optimizer = built, optimizer


def _load(target: Stateful, optimizer: Optimizer, state: Mapping[str, Any]) -> None:
    target.load_state_dict(dict(state["scheduler"]))
    for group, saved in zip(optimizer.param_groups, state["param_groups"], strict=True):
        for key, value in saved.items():
            if key in _NOT_HYPERPARAMETERS:
                continue
            mine = group.get(key)
            if isinstance(mine, torch.Tensor) and not isinstance(value, (list, tuple, dict)):
                mine.copy_(torch.as_tensor(value))  # captured CUDA graphs hold this tensor
            else:
                group[key] = copy.deepcopy(value)


def _check_stateful(name: str, obj: object) -> None:
    for method in ("state_dict", "load_state_dict"):
        if not callable(getattr(obj, method, None)):
            raise TypeError(
                f"{name}: {type(obj).__qualname__} has no {method}() method; register "
                "objects with state_dict() and load_state_dict() (torch's Stateful protocol)"
            )


def _check_name(name: object, taken: Mapping[str, object], what: str) -> str:
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS:
        raise ValueError(f"{what} name must be a non-empty str of <= {MAX_NAME_CHARS} chars")
    if name in taken:
        raise ValueError(f"{what} name {name!r} is already registered")
    if len(taken) >= MAX_OBJECTS:
        raise ValueError(f"{what} {name!r}: at most {MAX_OBJECTS} may be registered")
    return name


class TrainingState:
    """The registry and RNG choices of one rank; see the module docstring for what travels.

    The RNG choices are ``torchhook.rng.RngCarry``'s (``cuda_devices``: default the current
    device when CUDA is available, else none). The same script runs on every rank, so every
    rank makes the same registrations and choices; a snapshot from a differently configured
    rank is refused by :meth:`restore`."""

    def __init__(
        self,
        *,
        python_random: bool = False,
        numpy_random: bool = False,
        cuda_devices: Sequence[int] | None = None,
    ) -> None:
        self.rng = RngCarry(
            python_random=python_random, numpy_random=numpy_random, cuda_devices=cuda_devices
        )
        self._objects: dict[str, Stateful] = {}
        self._callbacks: dict[str, OnReset] = {}

    # -- registration ---------------------------------------------------------------------

    def register(self, name: str, obj: Any) -> None:
        """Carry ``obj``'s ``state_dict()`` under ``name`` (unique, checked here)."""
        _check_name(name, self._objects, "object")
        _check_stateful(repr(name), obj)
        self._objects[name] = obj

    def scheduler(
        self, name: str, factory: Callable[[Optimizer], S], optimizer: Optimizer
    ) -> Rebuilt[S]:
        """Register ``Rebuilt(factory, optimizer)`` under ``name`` and return it: step it
        (``.step()``) or its ``.current`` scheduler, never a reference kept from before a
        :meth:`rebind`."""
        _check_name(name, self._objects, "object")
        rebuilt = Rebuilt(factory, optimizer)
        self._objects[name] = rebuilt
        return rebuilt

    def rebuilt(self, name: str) -> Rebuilt[Any]:
        obj = self._objects.get(name)
        if not isinstance(obj, Rebuilt):
            raise KeyError(f"no Rebuilt object is registered as {name!r}")
        return obj

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._objects)

    def name_of(self, obj: object) -> str | None:
        """The name ``obj`` itself (not an equal object) is registered under, or None."""
        return next((name for name, known in self._objects.items() if known is obj), None)

    def rebind(self, optimizer: Optimizer) -> None:
        """A new optimizer: every :class:`Rebuilt` object is rebuilt over it, carrying its
        state. Call after the optimizer's own state is loaded (or not: the hyperparameters
        that a scheduler drives are written either way)."""
        for obj in self._objects.values():
            if isinstance(obj, Rebuilt):
                obj.rebind(optimizer)

    def on_reset(self, callback: OnReset, name: str | None = None) -> None:
        """Call ``callback(old, new)`` after each reconfiguration (module docstring)."""
        if not callable(callback):
            raise TypeError(f"on_reset needs a callable, got {type(callback).__qualname__}")
        if any(callback is known for known in self._callbacks.values()):
            raise ValueError(f"on_reset callback {callback!r} is already registered")
        if name is None:  # two lambdas share a qualname: number them
            qualname = getattr(callback, "__qualname__", type(callback).__qualname__)
            name = f"{qualname}#{len(self._callbacks)}"
        self._callbacks[_check_name(name, self._callbacks, "on_reset callback")] = callback

    def reset(self, old: World, new: World) -> None:
        """The engine's call after a reconfiguration: every callback, in order. Raises
        :class:`ResetCallbackError` from the first one that raises."""
        for key, callback in self._callbacks.items():
            try:
                callback(old, new)
            except Exception as exc:
                raise ResetCallbackError(
                    f"on_reset callback {key!r} raised {type(exc).__name__}: {exc}"
                ) from exc

    # -- capture and restore --------------------------------------------------------------

    def capture(self) -> Snapshot:
        """This rank's state now: a plain snapshot (copies; later steps do not change it)."""
        objects = {name: copy.deepcopy(obj.state_dict()) for name, obj in self._objects.items()}
        return {"version": SNAPSHOT_VERSION, "objects": objects, "rng": self.rng.capture()}

    def check(self, snapshot: object) -> Snapshot:
        """Raise :class:`SnapshotError` naming the first thing in ``snapshot`` that this
        state cannot load; nothing is loaded."""
        snap = check_shape(snapshot)
        missing = [n for n in self._objects if n not in snap["objects"]]
        unknown = [n for n in snap["objects"] if n not in self._objects]
        if missing or unknown:
            raise SnapshotError(
                f"snapshot objects differ from the registry: missing {missing}, unknown {unknown}"
            )
        for name, obj in self._objects.items():
            if isinstance(obj, Rebuilt):
                try:
                    obj.check(snap["objects"][name])
                except SnapshotError as exc:
                    raise SnapshotError(f"object {name!r}: {exc}") from None
        try:
            self.rng.check(snap["rng"])
        except RngStateError as exc:
            raise SnapshotError(str(exc)) from None
        return snap

    def restore(self, snapshot: object, *, rng: bool = True) -> None:
        """Load ``snapshot`` (validated whole first, see :meth:`check`). With ``rng=False``
        the RNG state is checked but this rank's own is kept. If an object's
        ``load_state_dict`` raises, the objects already loaded go back to their previous
        state and :class:`SnapshotError` names the object (its error is the cause)."""
        snap = self.check(snapshot)
        backup = {name: copy.deepcopy(obj.state_dict()) for name, obj in self._objects.items()}
        loaded: list[str] = []
        for name, obj in self._objects.items():
            try:
                obj.load_state_dict(copy.deepcopy(snap["objects"][name]))
            except Exception as exc:
                for done in loaded:
                    self._objects[done].load_state_dict(backup[done])
                raise SnapshotError(
                    f"object {name!r} refused its state ({type(exc).__name__}: {exc}); "
                    f"the {len(loaded)} objects loaded before it were restored"
                ) from exc
            loaded.append(name)
        if rng:
            self.rng.load(snap["rng"])


def check_shape(snapshot: object) -> Snapshot:
    """The registry-independent checks: a dict of ``version``, ``objects`` (names to their
    states) and ``rng`` (generator kinds to states)."""
    if not isinstance(snapshot, dict) or set(snapshot) != {"version", "objects", "rng"}:
        raise SnapshotError("a snapshot is a dict of exactly 'version', 'objects' and 'rng'")
    if snapshot["version"] != SNAPSHOT_VERSION:
        raise SnapshotError(f"snapshot version {snapshot['version']!r} is not {SNAPSHOT_VERSION}")
    objects, rng = snapshot["objects"], snapshot["rng"]
    if not isinstance(objects, dict) or not all(isinstance(k, str) for k in objects):
        raise SnapshotError("snapshot 'objects' is not a dict keyed by name")
    if len(objects) > MAX_OBJECTS:
        raise SnapshotError(f"snapshot holds {len(objects)} objects, above {MAX_OBJECTS}")
    if not isinstance(rng, dict) or not set(rng) <= set(KINDS):
        raise SnapshotError("snapshot 'rng' is not a dict of torch, cuda, python, numpy states")
    return Snapshot(version=snapshot["version"], objects=objects, rng=rng)
