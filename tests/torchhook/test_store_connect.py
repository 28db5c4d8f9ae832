"""A trainer connecting to a stopped leader's store gives up in bounded time and keeps
heartbeating (the hung-trainer flake: a live trainer blocked in TCPStore's constructor
against a SIGSTOPped leader, stopped beating, and was flagged hung itself)."""

from __future__ import annotations

import socket
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("torch", reason="the torch hook needs torch (pip install '.[torch]')")

from torchhook import elastic


def test_a_store_that_accepts_but_never_answers_is_given_up_while_beating() -> None:
    # listen() without accept(): the kernel completes the TCP handshake, nobody answers,
    # which is what a stopped process's listening socket does
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        beats: list[int] = []
        trainer = elastic.ElasticDDP.__new__(elastic.ElasticDDP)  # only what the method uses
        trainer.step, trainer._last_beat = 7, 0.0
        trainer.membership = SimpleNamespace(heartbeat=beats.append)  # type: ignore[assignment]
        started = time.monotonic()
        with pytest.raises(elastic._Retry, match="no answer within"):
            trainer._connect_store("127.0.0.1", port, "directory")
        took_s = time.monotonic() - started
    assert took_s < elastic.STORE_CONNECT.total_seconds() + 1.0
    assert len(beats) >= 2 and set(beats) == {7}  # the agent kept hearing from us
