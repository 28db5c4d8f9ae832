"""swim.frozen.fast_init: the replaced ``__init__`` of every frozen value type in swim.messages,
swim.effects and swim.timers takes the same arguments as the generated one, stores the
same fields, and the value stays frozen; unsupported dataclasses are refused at import."""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field

import pytest

from swim import effects, messages, timers
from swim.frozen import fast_init


def _frozen_classes() -> list[type]:
    found: list[type] = []
    for module in (messages, effects, timers):
        for value in vars(module).values():
            if (
                isinstance(value, type)
                and value.__module__ == module.__name__
                and dataclasses.is_dataclass(value)
                and value.__dataclass_params__.frozen  # type: ignore[attr-defined]
                and value not in found
            ):
                found.append(value)
    return found


CLASSES = _frozen_classes()


def _reference(cls: type) -> type:
    """The same fields as a fresh dataclass with the generated ``__init__``."""
    spec = [
        (f.name, f.type, field(default=f.default))
        if f.default is not dataclasses.MISSING
        else (f.name, f.type)
        for f in dataclasses.fields(cls)
    ]
    return dataclasses.make_dataclass(cls.__name__, spec, frozen=True, slots=True)


def test_every_frozen_value_type_is_covered() -> None:
    assert len(CLASSES) >= 30
    inits = {c: vars(c)["__init__"] for c in CLASSES}
    generated = [c for c, init in inits.items() if "__setattr__" in init.__code__.co_names]
    assert generated == [], "still the generated __init__ (object.__setattr__ per field)"


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_same_signature_same_fields_still_frozen(cls: type) -> None:
    ours, reference = vars(cls)["__init__"], vars(_reference(cls))["__init__"]
    assert inspect.signature(ours) == inspect.signature(reference)
    names = [f.name for f in dataclasses.fields(cls)]
    values = [f"v{i}" for i in range(len(names))]
    made = cls(*values)
    assert [getattr(made, n) for n in names] == values
    assert made == cls(**dict(zip(names, values, strict=True)))
    if names:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(made, names[0], "other")


def test_defaults_apply() -> None:
    ping = messages.Ping(7, "n1")
    assert (ping.source_addr, ping.source_port, ping.source_node) == (b"", 0, "")
    with pytest.raises(TypeError):
        messages.Ping(7)  # type: ignore[call-arg]


def test_unsupported_dataclasses_are_refused() -> None:
    @dataclass(frozen=True, slots=True)
    class WithFactory:
        items: list[int] = field(default_factory=list)

    @dataclass(slots=True)
    class NotFrozen:
        x: int

    @dataclass(frozen=True, slots=True)
    class WithPostInit:
        x: int

        def __post_init__(self) -> None:
            pass

    @dataclass(frozen=True)
    class NoSlots:
        x: int

    for cls in (WithFactory, NotFrozen, WithPostInit, NoSlots):
        with pytest.raises(TypeError):
            fast_init(cls)
