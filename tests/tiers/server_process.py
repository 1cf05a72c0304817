"""Control of a test server running as a child process: SIGKILL, SIGSTOP/SIGCONT, stop."""

from __future__ import annotations

import os
import signal
import subprocess


class ServerProcess:
    """Base of the test servers (redis-server, moto): ``proc`` is the running child, if any."""

    proc: subprocess.Popen[bytes] | None = None

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
