"""The pure control-API module: framing, request validation against the ``OPS`` table,
default socket path; and that the server's handler tables cover exactly ``OPS``."""

from __future__ import annotations

import contextlib
from pathlib import Path

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent import control
from agent.control import ControlError, FrameDecoder


def test_frames_round_trip_in_any_chunking() -> None:
    frames = [
        control.make_request("members", status="alive"),
        control.ok([1, 2]),
        control.error("nope"),
    ]
    data = b"".join(control.encode_frame(f) for f in frames)
    for size in (1, 3, 7, len(data)):
        decoder = FrameDecoder()
        got = []
        for i in range(0, len(data), size):
            got.extend(decoder.feed(data[i : i + size]))
        assert got == frames


def test_oversized_and_bad_frames_are_refused() -> None:
    with pytest.raises(ControlError, match="exceeds"):
        FrameDecoder(max_frame_bytes=10).feed(control.HEADER.pack(11) + b"x" * 11)
    with pytest.raises(ControlError, match="a frame must hold a map"):
        FrameDecoder().feed(control.HEADER.pack(1) + msgpack.packb(1))
    with pytest.raises(ControlError, match="bad frame"):
        FrameDecoder().feed(control.HEADER.pack(1) + b"\xc1")


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        ({"v": 2, "op": "info"}, "protocol version"),
        ({"v": 1, "op": "rm -rf"}, "unknown op"),
        ({"v": 1, "op": "info", "args": [1]}, "args must be a map"),
    ],
)
def test_bad_requests(frame: dict[str, object], message: str) -> None:
    with pytest.raises(ControlError, match=message):
        control.parse_request(frame)


@pytest.mark.parametrize("op", sorted(control.OPS))
def test_every_op_has_one_handler_and_a_documented_schema(op: str) -> None:
    from agent import control_server

    spec = control.OPS[op]
    assert (op in control_server.HANDLERS) != (op in control_server.STREAMS)
    assert (op in control_server.STREAMS) == spec.streaming == (op in control.STREAMING_OPS)
    assert not set(spec.required) & set(spec.optional)
    assert f"``{op}``" in (control.__doc__ or ""), "every op has its line in the schema"


@pytest.mark.parametrize("op", sorted(control.OPS))
def test_arguments_are_checked_against_the_table(op: str) -> None:
    spec = control.OPS[op]
    args = dict.fromkeys(spec.required + spec.optional, "x")
    assert control.parse_request({"v": 1, "op": op, "args": args}) == (op, args)
    with pytest.raises(ControlError, match=f"bad arguments: {op} unexpected argument 'bogus'"):
        control.parse_request({"v": 1, "op": op, "args": {**args, "bogus": 1}})
    for name in spec.required:
        short = {k: v for k, v in args.items() if k != name}
        with pytest.raises(ControlError, match=f"missing argument '{name}'"):
            control.parse_request({"v": 1, "op": op, "args": short})


def test_make_request_refuses_unknown_ops() -> None:
    with pytest.raises(ControlError, match="unknown operation"):
        control.make_request("explode")
    assert control.parse_request(control.make_request("join", addrs=["a"])) == (
        "join",
        {"addrs": ["a"]},
    )


def test_default_path_order(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("SWIM_CONTROL", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    assert control.default_control_path() == Path("/run/swim/agent.sock")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert control.default_control_path() == tmp_path / "swim" / "agent.sock"
    monkeypatch.setenv("SWIM_CONTROL", "/x/y.sock")
    assert control.default_control_path() == Path("/x/y.sock")


def test_client_reports_an_unreachable_agent(tmp_path: Path) -> None:
    client = control.ControlClient(tmp_path / "nobody.sock", timeout_s=1)
    with pytest.raises(ControlError, match="cannot reach the agent"):
        client.request("info")


@given(st.binary(max_size=512))
def test_decoder_raises_only_control_error(data: bytes) -> None:
    with contextlib.suppress(ControlError):
        FrameDecoder(max_frame_bytes=1024).feed(data)
