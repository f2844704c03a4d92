"""A real ``redis-server`` for tests and benchmarks: started on a free loopback
port with its files in a temporary directory and no persistence, stopped (and
killed if it will not stop) on exit. ``RedisProcess`` is the one process the
cluster, Sentinel and TLS set-ups (``tools.redis_cluster``,
``tools.redis_sentinel``, ``tools.redis_tls``) start several of."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

#: How long ``redis-server`` may take to answer its first PING.
START_TIMEOUT_S = 10.0

#: No persistence: a test's data lives only in memory.
NO_PERSISTENCE = ("--save", "", "--appendonly", "no")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def _binary() -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError(
            "redis-server not found: run scripts/setup.sh --with-test-services"
        )
    return binary


class RedisProcess:
    """One ``redis-server`` (or sentinel) answering PING on ``port`` of
    127.0.0.1 once constructed. ``args`` go after the binary; the port, the
    bind address and the working directory are added."""

    def __init__(self, args: Sequence[str], port: int, directory: str) -> None:
        self.port = port
        self.process = subprocess.Popen(
            [
                _binary(), *args,
                "--port", str(port), "--bind", "127.0.0.1", "--dir", directory,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _answers(port):
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"redis-server exited with {self.process.returncode} on port {port}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not answer on port {port}")
            time.sleep(0.02)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def kill(self) -> None:
        """SIGKILL: the process ends at once, as in a crash."""
        self.process.kill()
        self.process.wait()

    def stop(self) -> None:
        """Stops the process (SIGTERM, SIGKILL after 5 s); a dead one is left."""
        if self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.kill()


@contextmanager
def redis_server() -> Iterator[str]:
    """Runs ``redis-server`` for the duration of the block and yields its URL
    (``redis://127.0.0.1:PORT/0``). Raises RuntimeError when it is missing
    (``scripts/setup.sh --with-test-services`` installs it) or does not start."""
    with tempfile.TemporaryDirectory(prefix="redis-") as directory:
        server = RedisProcess(NO_PERSISTENCE, free_port(), directory)
        try:
            yield f"redis://127.0.0.1:{server.port}/0"
        finally:
            server.stop()
