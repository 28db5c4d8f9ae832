"""A real headless Chromium driven over the DevTools protocol on a pipe, for the status
page's browser test (tests/agent/test_status_page.py).

``--remote-debugging-pipe``: Chromium reads protocol messages on its fd 3 and writes on
its fd 4, each a JSON object followed by a NUL byte (Chrome DevTools Protocol, "pipe
transport"), so no websocket client is needed. One browser, one page target, commands
answered in order; events are kept only as far as ``wait_event`` needs them.

Rules: every read has a deadline (``select`` on the pipe); the browser runs in its own
process group with a temporary profile, and ``close`` stops it by pid (agent/procs.py).
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import select
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from agent.procs import stop

__all__ = ["Chromium", "ChromiumError", "chromium_binary"]

COMMAND_TIMEOUT_S = 20.0
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
"""A screenshot of a large page is a few MB of base64; anything beyond this is a bug."""


class ChromiumError(RuntimeError):
    pass


def chromium_binary() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


class Chromium:
    """``with Chromium() as browser: browser.navigate(url); browser.evaluate(js)``."""

    def __init__(self, width: int = 1280, height: int = 900) -> None:
        binary = chromium_binary()
        if binary is None:
            raise ChromiumError("no chromium on PATH")
        self._profile = tempfile.mkdtemp(prefix="swim-chromium-")
        self._log = tempfile.TemporaryFile(prefix="swim-chromium-log-")  # noqa: SIM115 - closed by close()
        pipe_in, self._to_browser = os.pipe()
        self._from_browser, pipe_out = os.pipe()
        # the child's ends, moved above 9 so that bash's "3<&N 4>&M" cannot clobber them
        # (bash, not sh: dash takes single-digit descriptors only)
        child_in = fcntl.fcntl(pipe_in, fcntl.F_DUPFD_CLOEXEC, 10)
        child_out = fcntl.fcntl(pipe_out, fcntl.F_DUPFD_CLOEXEC, 10)
        for fd in (pipe_in, pipe_out):
            os.close(fd)
        args = [
            binary,
            "--headless=new",
            "--no-sandbox",  # tests run as root; the sandbox refuses root
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-extensions",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--hide-scrollbars",
            "--mute-audio",
            f"--window-size={width},{height}",
            f"--user-data-dir={self._profile}",
            "--remote-debugging-pipe",
            "about:blank",
        ]
        # Chromium's fd 3 reads our commands and its fd 4 writes its replies
        redirect = f'exec "$0" "$@" 3<&{child_in} 4>&{child_out} {child_in}<&- {child_out}>&-'
        try:
            self.proc = subprocess.Popen(
                ["/bin/bash", "-c", redirect, *args],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=self._log,
                pass_fds=(child_in, child_out),
                process_group=0,
            )
        finally:
            os.close(child_in)
            os.close(child_out)
        self._buffer = b""
        self._next_id = 0
        self._events: list[dict[str, Any]] = []
        self.session = ""
        try:
            self._attach()
        except ChromiumError as exc:
            tail = self.log_tail()
            self.close()
            raise ChromiumError(f"{exc}; chromium's log ends:\n{tail}") from None
        except BaseException:
            self.close()
            raise

    def log_tail(self, limit: int = 2000) -> str:
        """The end of chromium's stderr (for a failure's message)."""
        try:
            self._log.seek(0)
            return self._log.read().decode(errors="replace")[-limit:]
        except (OSError, ValueError):
            return "(no log)"

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """``Browser.close`` first, so the browser reaps its own helper processes (killed
        from outside they would be orphans some inits never reap), then by pid and group."""
        try:
            if self.proc.poll() is None:
                with contextlib.suppress(ChromiumError, OSError):
                    self.send("Browser.close", session="", timeout_s=5)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(5)
                stop(self.proc, sig=signal.SIGTERM, timeout_s=5, group=True)
        finally:
            for fd in (self._to_browser, self._from_browser):
                with contextlib.suppress(OSError):
                    os.close(fd)
            shutil.rmtree(self._profile, ignore_errors=True)
            self._log.close()

    # --- the protocol ------------------------------------------------------------------

    def _read_message(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ChromiumError("no message from chromium in time")
            ready, _, _ = select.select([self._from_browser], [], [], left)
            if not ready:
                continue
            chunk = os.read(self._from_browser, 1 << 20)
            if not chunk:
                raise ChromiumError(f"chromium closed its pipe (exit {self.proc.poll()})")
            self._buffer += chunk
            if len(self._buffer) > MAX_MESSAGE_BYTES:
                raise ChromiumError("a message from chromium is too large")
        raw, _, self._buffer = self._buffer.partition(b"\0")
        message: dict[str, Any] = json.loads(raw)
        return message

    def send(
        self,
        method: str,
        params: dict[str, Any] | None = None,
        *,
        session: str | None = None,
        timeout_s: float = COMMAND_TIMEOUT_S,
    ) -> dict[str, Any]:
        """One command; its result (``ChromiumError`` for a protocol error)."""
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        target_session = self.session if session is None else session
        if target_session:
            message["sessionId"] = target_session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout_s
        while True:
            reply = self._read_message(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise ChromiumError(f"{method}: {reply['error']}")
                result: dict[str, Any] = reply.get("result", {})
                return result
            if "method" in reply:
                self._events.append(reply)
                del self._events[:-256]  # only recent events matter (bounded)

    def wait_event(self, method: str, timeout_s: float = COMMAND_TIMEOUT_S) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            for i, event in enumerate(self._events):
                if event.get("method") == method:
                    del self._events[: i + 1]
                    return event
            self._events.clear()
            message = self._read_message(deadline)
            if "method" in message:
                self._events.append(message)

    def _attach(self) -> None:
        targets = self.send("Target.getTargets", session="")["targetInfos"]
        page = next((t for t in targets if t["type"] == "page"), None)
        if page is None:
            target_id = self.send("Target.createTarget", {"url": "about:blank"}, session="")[
                "targetId"
            ]
        else:
            target_id = page["targetId"]
        self.session = self.send(
            "Target.attachToTarget", {"targetId": target_id, "flatten": True}, session=""
        )["sessionId"]
        self.send("Page.enable")
        self.send("Runtime.enable")

    # --- what tests use --------------------------------------------------------------------

    def navigate(self, url: str, timeout_s: float = COMMAND_TIMEOUT_S) -> None:
        self._events.clear()
        result = self.send("Page.navigate", {"url": url})
        if result.get("errorText"):
            raise ChromiumError(f"navigating to {url}: {result['errorText']}")
        self.wait_event("Page.loadEventFired", timeout_s)

    def evaluate(self, expression: str) -> Any:
        """The JSON value of a JavaScript expression in the page (promises awaited)."""
        result = self.send(
            "Runtime.evaluate",
            {"expression": expression, "returnByValue": True, "awaitPromise": True},
        )
        if "exceptionDetails" in result:
            raise ChromiumError(f"{expression!r} threw: {result['exceptionDetails']}")
        return result["result"].get("value")

    def screenshot(self, path: Path) -> Path:
        data = self.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True})
        path.write_bytes(base64.b64decode(data["data"]))
        return path
