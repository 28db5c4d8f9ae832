"""The stores of bench.formation_scale: one real TCPStore server on loopback, a client
connection per rank made once before anything is timed, and each formation's fresh store
as a fresh key prefix on that server (the benchmark's docstring says why)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta

from torch._C._distributed_c10d import TCPStore

from torchhook.stores import TcpNet

JOIN_TIMEOUT_S = 60.0
"""A formation that has not ended by then is reported as failed (it should take < 1 s)."""


class Prefixed:
    """A store on the shared benchmark server: ``client``'s keys under ``prefix``. Stands
    for a fresh store (a fresh prefix per formation) reached over an open connection."""

    def __init__(self, client: TCPStore, prefix: str, port: int) -> None:
        self.client = client
        self.prefix = prefix
        self._port = port

    def _keys(self, keys: list[str]) -> list[str]:
        return [self.prefix + k for k in keys]

    def set(self, key: str, value: str) -> None:
        self.client.set(self.prefix + key, value)

    def get(self, key: str) -> bytes:
        return self.client.get(self.prefix + key)

    def compare_set(self, key: str, expected_value: str, desired_value: str) -> bytes:
        return self.client.compare_set(self.prefix + key, expected_value, desired_value)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self.client.multi_get(self._keys(keys))

    def delete_key(self, key: str) -> bool:
        return self.client.delete_key(self.prefix + key)

    def check(self, keys: list[str]) -> bool:
        return self.client.check(self._keys(keys))

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        self.client.wait(self._keys(keys), timeout)

    def set_timeout(self, timeout: timedelta) -> None:
        """The connection is shared: it keeps its own timeout."""

    @property
    def port(self) -> int:
        return self._port


class Server:
    """One TCPStore server and a client per rank, connected once for every size."""

    DIRECTORY = 1

    def __init__(self, clients: int, port: int = 0, formations: int = 0) -> None:
        """A new server, or with ``port`` the clients of another process's server (a
        worker of ``--processes``); fresh formation prefixes are numbered from
        ``formations`` on."""
        self.store = (
            None
            if port
            else TCPStore(
                "127.0.0.1",
                0,
                is_master=True,
                wait_for_workers=False,
                timeout=timedelta(seconds=JOIN_TIMEOUT_S),
            )
        )
        self.port = port or self.store.port  # type: ignore[union-attr]
        began = time.perf_counter()
        made: list[TCPStore | None] = [None] * clients

        def connect(i: int) -> None:
            made[i] = TCPStore(
                "127.0.0.1",
                self.port,
                is_master=False,
                timeout=timedelta(seconds=JOIN_TIMEOUT_S),
            )

        threads = [threading.Thread(target=connect, args=(i,)) for i in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.connect_s = time.perf_counter() - began
        self.clients = [c for c in made if c is not None]
        assert len(self.clients) == clients, "every client connected"
        self.formations = formations


class RankNet(TcpNet):
    """``TcpNet`` on the shared server: the directory and each formation's store are
    prefixes there (ports are names for them), reached over this rank's connection."""

    def __init__(self, server: Server, index: int, size: int) -> None:
        self.server = server
        self.client = server.clients[index]
        self.directory = f"dir{size}/"
        self.served = 0

    def serve(self, host: str, timeout: timedelta) -> Prefixed:  # type: ignore[override]
        self.served += 1
        if self.served == 1:
            return Prefixed(self.client, self.directory, Server.DIRECTORY)
        self.server.formations += 1  # a fresh prefix per formation, never reused
        port = 1000 + self.server.formations
        return Prefixed(self.client, f"f{port}/", port)

    def connect(  # type: ignore[override]
        self, addr: str, port: int, what: str, beat: Callable[[], None]
    ) -> Prefixed:
        prefix = self.directory if port == Server.DIRECTORY else f"f{port}/"
        return Prefixed(self.client, prefix, port)
