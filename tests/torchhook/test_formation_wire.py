"""The formation records (torchhook/formation_wire.py): every record survives the store,
and bytes that are not a whole record of the right kind and version raise ``WireError``
(never ``struct.error``, ``IndexError`` or ``UnicodeDecodeError``)."""

from __future__ import annotations

import base64
import contextlib
import random
import struct
from collections.abc import Callable

import pytest

from torchhook.formation_wire import (
    MAX_TEXT_BYTES,
    Offer,
    WireError,
    WireVersionError,
    decode_claim,
    decode_claims,
    decode_offer,
    decode_plan,
    encode_claim,
    encode_offer,
    encode_plan,
)
from torchhook.strategy import Layout, Node, Plan, RankInfo, decide

BIG = Layout(tuple(Node(f"node-{i:03d}.ü", 1_700_000_000_000 + i, 8) for i in range(64)))
SMALL = Layout((Node("a", 1, 2), Node("b", 2, 2)))
OFFER = Offer("fp-1", 29500, "0123456789abcdef", BIG)
INFO = RankInfo("T", BIG, 7, True, "T", "U")
PLAN = Plan("shrink", (2, 3), 10, "memory", 0, (0, 1), tuple(range(4, 512)), (1,))


def test_records_survive_the_store() -> None:
    assert decode_offer(encode_offer(OFFER)) == OFFER
    assert decode_offer(encode_offer(OFFER).encode()) == OFFER  # a store returns bytes
    assert decode_offer(encode_offer(Offer("", 0, "", Layout(())))).layout == Layout(())
    for info in (INFO, RankInfo("", None, 0, False), RankInfo("g", SMALL, -1, False, "", "")):
        assert decode_claim(encode_claim(info)) == info
    for plan in (PLAN, Plan("reform", (), 0, "fresh", 0), Plan("reform", (), 3, "checkpoint", 0)):
        assert decode_plan(encode_plan(plan)) == plan
    fresh = [RankInfo("", None, 0, False)] * 512
    plan = decide(BIG, fresh, backend="gloo", supports_shrinking=False)
    assert decode_plan(encode_plan(plan)) == plan and len(plan.receivers) == 511


def test_claims_of_one_group_share_one_decoded_layout() -> None:
    other = RankInfo("T", SMALL, 7, True, "T", "")
    raws = [encode_claim(i).encode() for i in (INFO, INFO, other, RankInfo("", None, 0, False))]
    infos = decode_claims(raws)
    assert infos == [INFO, INFO, other, RankInfo("", None, 0, False)]
    assert infos[0].layout is infos[1].layout  # decoded once


@pytest.mark.parametrize(
    "record",
    [encode_offer(OFFER), encode_claim(INFO), encode_plan(PLAN)],
    ids=["offer", "claim", "plan"],
)
def test_truncated_or_extended_records_are_refused(record: str) -> None:
    decoders: dict[str, Callable[[bytes], object]] = {
        "T": decode_offer,
        "Q": decode_claim,
        "U": decode_plan,
    }
    decode = decoders[record[0]]
    raw = base64.b64decode(record)
    for cut in range(len(raw)):
        with pytest.raises(WireError):
            decode(base64.b64encode(raw[:cut]))
    with pytest.raises(WireError, match=r"trail|names"):  # a layout ends offers and claims
        decode(base64.b64encode(raw + b"\x00"))


def test_hostile_bytes_raise_wire_error_only() -> None:
    rng = random.Random(24)
    records = [encode_offer(OFFER), encode_claim(INFO), encode_plan(PLAN)]
    decoders: list[Callable[[bytes | str], object]] = [decode_offer, decode_claim, decode_plan]
    for _ in range(3000):
        raw = bytearray(base64.b64decode(rng.choice(records)))
        for _ in range(rng.randint(1, 4)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        for decode in decoders:
            with contextlib.suppress(WireError):  # anything else fails the test
                decode(base64.b64encode(raw))
    for text in ["", "retry", "error: x", "{}", "not base64!", "\x00" * 8, "QUFB" * 3]:
        for decode in decoders:
            with pytest.raises(WireError):
                decode(text)


def test_a_record_of_another_kind_or_version_is_refused() -> None:
    with pytest.raises(WireError, match="kind"):
        decode_plan(encode_offer(OFFER))
    raw = bytearray(base64.b64decode(encode_plan(PLAN)))
    raw[1] = 2
    with pytest.raises(WireVersionError, match="same torchhook"):
        decode_plan(base64.b64encode(raw))


def test_counts_larger_than_the_bytes_allocate_nothing() -> None:
    # a plan whose first rank list claims 2^32 - 1 ranks in a few bytes
    head = struct.pack("<cBBBqI", b"P", 1, 0, 0, 1, 0) + struct.pack("<I", 2**32 - 1)
    with pytest.raises(WireError, match="values"):
        decode_plan(base64.b64encode(head + b"\x00" * 16))
    # an offer whose layout claims 65,535 nodes
    offer = struct.pack("<cBH", b"O", 1, 1) + struct.pack("<H", 0) * 2 + struct.pack("<H", 65535)
    with pytest.raises(WireError, match="values"):
        decode_offer(base64.b64encode(offer))


def test_values_that_do_not_fit_are_refused_when_encoding() -> None:
    with pytest.raises(WireError, match="longer than"):
        encode_offer(Offer("x" * (MAX_TEXT_BYTES + 1), 1, "t", SMALL))
    with pytest.raises(WireError, match="port"):
        encode_offer(Offer("fp", 70000, "t", SMALL))
    with pytest.raises(WireError, match="ranks"):
        encode_plan(Plan("reform", (), 0, "fresh", 0, receivers=(-1,)))
    for name in ("a\x00b", ""):
        with pytest.raises(WireError, match="NUL"):
            encode_offer(Offer("fp", 1, "t", Layout((Node(name, 1, 2),))))
    with pytest.raises(WireError, match="local ranks"):
        encode_offer(Offer("fp", 1, "t", Layout((Node("a", 1, 70000),))))
