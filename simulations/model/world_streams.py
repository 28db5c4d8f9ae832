"""Streams (TCP) in the world: dialling, serving, replies and their timing.

Rules: a stream connection costs three one-way delays (SYN, SYN-ACK, data) before the
server sees it (lossy TCP: ``Network.stream_open``); a dead server refuses; a dial or a
reply that cannot arrive in time times out at the request's deadline; what the two ends
read off the bytes: ``simulations.model.streams``. A mixin of ``World``
(``simulations.model.world``), which owns the event queue and applies outputs.
"""

from __future__ import annotations

from typing import Any

from simulations.model.network import Network
from simulations.model.streams import read_reply, read_request
from simulations.model.world_types import K_RESULT, K_SERVE, Traffic
from swim import Address, Node, Output, StreamRequest


class WorldStreams:
    now_ms: int
    nodes: list[Node]
    network: Network
    traffic: Traffic
    _addr_idx: dict[Address, int]

    def _push(self, t: int, kind: int, idx: int, a: Any, b: Any) -> None:
        raise NotImplementedError

    def _apply(self, idx: int, node: Node, out: Output) -> None:
        raise NotImplementedError

    def _open_stream(self, idx: int, node: Node, request: StreamRequest) -> None:
        traffic = self.traffic
        traffic.streams_out[idx] += 1
        traffic.stream_bytes_out[idx] += len(request.data)
        dst = self._addr_idx.get(request.dest)
        budget = request.deadline_ms - self.now_ms
        t, d = (-1, 0) if dst is None else self.network.stream_open(idx, dst, budget)
        if dst is None or t < 0:
            # no route, filtered, or (lossy TCP) too slow: the dial times out at the deadline
            self._result_at(request.deadline_ms, idx, node, request.stream_id, None, "timeout")
            return
        self._push(self.now_ms + t, K_SERVE, dst, (idx, node, d), request)

    def _result_at(
        self, t: int, idx: int, node: Node, stream_id: int, reply: bytes | None, error: str
    ) -> None:
        if self.nodes[idx] is not node:
            return
        self._push(max(t, self.now_ms), K_RESULT, idx, node, (stream_id, reply, error))

    def _refuse(self, a: tuple[int, Node, int], request: StreamRequest) -> None:
        src, src_node, d = a
        self._result_at(self.now_ms + d, src, src_node, request.stream_id, None, "refused")

    def _serve(
        self, idx: int, node: Node, a: tuple[int, Node, int], request: StreamRequest
    ) -> None:
        src, src_node, d = a
        traffic = self.traffic
        traffic.streams_in[idx] += 1
        traffic.stream_bytes_in[idx] += len(request.data)
        message = read_request(node, request.data)
        if message is None:
            self._result_at(self.now_ms + d, src, src_node, request.stream_id, None, "bad request")
            return
        out = node.handle_stream(src_node.address, message, self.now_ms)
        reply = out.reply
        self._apply(idx, node, out)
        if not request.expect_reply:
            return
        if reply is None:
            self._result_at(self.now_ms + d, src, src_node, request.stream_id, None, "no reply")
            return
        traffic.stream_bytes_out[idx] += len(reply)
        back = self.network.stream_reply(idx, src, request.deadline_ms - self.now_ms)
        if back < 0:
            self._result_at(request.deadline_ms, src, src_node, request.stream_id, None, "timeout")
        else:
            self._result_at(self.now_ms + back, src, src_node, request.stream_id, reply, "")

    def _stream_result(self, idx: int, node: Node, b: tuple[int, bytes | None, str]) -> Output:
        stream_id, reply, error = b
        if reply is not None:
            self.traffic.stream_bytes_in[idx] += len(reply)
        message, error = read_reply(node, reply, error)
        return node.handle_stream_response(stream_id, message, self.now_ms, error)


__all__ = ["WorldStreams"]
