"""A real ``redis-server`` for tests and benchmarks: started on a free loopback
port with its files in a temporary directory and no persistence, stopped (and
killed if it will not stop) on exit."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

#: How long ``redis-server`` may take to answer its first PING.
START_TIMEOUT_S = 10.0


def _free_port() -> int:
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


@contextmanager
def redis_server() -> Iterator[str]:
    """Runs ``redis-server`` for the duration of the block and yields its URL
    (``redis://127.0.0.1:PORT/0``). Raises RuntimeError when it is missing
    (``scripts/setup.sh --with-test-services`` installs it) or does not start."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError(
            "redis-server not found: run scripts/setup.sh --with-test-services"
        )
    with tempfile.TemporaryDirectory(prefix="redis-") as directory:
        port = _free_port()
        process = subprocess.Popen(
            [
                binary,
                "--port", str(port),
                "--bind", "127.0.0.1",
                "--save", "",
                "--appendonly", "no",
                "--dir", directory,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while not _answers(port):
                if process.poll() is not None:
                    raise RuntimeError(
                        f"redis-server exited with {process.returncode} on port {port}"
                    )
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not answer on port {port}")
                time.sleep(0.02)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            process.terminate()
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
