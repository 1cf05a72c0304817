"""Control of a test server running as a child process: SIGKILL, SIGSTOP/SIGCONT, stop."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable
from typing import TypeVar


class ServerProcess:
    """Base of the test servers (redis-server, moto): ``proc`` is the running child, if any."""

    proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> None:
        """Start the server (on its port) and wait until it answers; RuntimeError if it does not."""
        raise NotImplementedError

    def kill(self) -> None:
        """SIGKILL the server and wait for it to die."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def pause(self) -> None:
        """SIGSTOP: the kernel still accepts connections, nothing answers (a hung server)."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
        self.kill()
        self.proc = None


ServerT = TypeVar("ServerT", bound=ServerProcess)


def start_on_a_free_port(make: Callable[[], ServerT], what: str, attempts: int = 5) -> ServerT:
    """``make()`` a server on a fresh free port and start it, retrying: a port found free can be
    taken by someone else before the server binds it."""
    last: Exception | None = None
    for _ in range(attempts):
        server = make()
        try:
            server.start()
            return server
        except RuntimeError as exc:
            last = exc
            server.stop()
    raise RuntimeError(f"could not start {what}: {last}")
