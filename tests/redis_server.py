"""A real redis-server on a free loopback port, started, killed and restarted by the tests."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from infermeter.serving import free_port

__all__ = ["RedisServer"]


class RedisServer:
    """Debian's redis-server, without persistence, in its own directory."""

    def __init__(self, directory: Path, port: int | None = None, unix_socket: bool = False) -> None:
        """``port``: where it listens (a free one by default); kept across restarts.
        ``unix_socket``: also listen on ``redis.sock`` in ``directory``.
        """
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (make system-deps)")
        self.binary = binary
        self.directory = directory
        self.port = port or free_port()
        self.unix_socket = directory / "redis.sock" if unix_socket else None
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The redis:// URL of the server."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start the server and wait until it answers PING."""
        self.directory.mkdir(parents=True, exist_ok=True)
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.directory),
            "--protected-mode",
            "no",
        ]
        if self.unix_socket is not None:
            args += ["--unixsocket", str(self.unix_socket)]
        log = (self.directory / "redis.log").open("ab")
        self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.process.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    def kill(self) -> None:
        """SIGKILL the server: everything it held is gone."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()
        self.process = None

    def pause(self) -> None:
        """SIGSTOP the server: it keeps its connections and keys but answers nothing."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT a paused server: it answers again, the commands it was sent first."""
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def flush(self) -> None:
        """Forget every key (between tests sharing the server)."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=2) as s:
            s.sendall(b"FLUSHALL\r\n")
            s.recv(16)
