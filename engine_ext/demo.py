"""The demo: a real vLLM server on the tiny local model with per-user limits,
several concurrent streams per user, measured tok/s printed beside each limit.

``python -m engine_ext.demo [--model-dir DIR] [--tokens N]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from engine_ext.measure import rates_by_user, run_streams
from engine_ext.tiny_model import ensure_tiny_model

DEFAULT_RATE = 1000
USER_RATES = {"user-a": 20, "user-b": 100}
STREAMS = {"user-a": 4, "user-b": 3, "user-c": 2}  # user-c gets the default


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model-dir",
        default=os.path.join(tempfile.gettempdir(), "output-rate-tiny-model"),
        help="where the tiny model is generated (reused when present)",
    )
    parser.add_argument("--tokens", type=int, default=200, help="tokens per stream")
    args = parser.parse_args(argv)

    model_dir = str(ensure_tiny_model(args.model_dir))
    port = _free_port()
    log_path = Path(tempfile.gettempdir()) / f"output-rate-demo-{port}.log"
    print(f"starting vLLM (tiny model at {model_dir}) on 127.0.0.1:{port} ...")
    print(f"server log: {log_path}")
    server = subprocess.Popen(
        [
            sys.executable, "-m", "engine_ext.serve", model_dir,
            "--host", "127.0.0.1", "--port", str(port),
            "--max-model-len", "512", "--gpu-memory-utilization", "0.3",
            "--max-num-seqs", "32",
            "--default-user-output-tokens-per-second", str(DEFAULT_RATE),
            "--user-output-tokens-per-second", json.dumps(USER_RATES),
        ],
        env=dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1"),
        stdout=log_path.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    try:
        base_url = f"http://127.0.0.1:{port}"
        _wait_healthy(server, base_url, log_path)
        streams = [(u, args.tokens) for u, n in STREAMS.items() for _ in range(n)]
        print(f"server up; {len(streams)} streams of {args.tokens} tokens each ...")
        results = asyncio.run(run_streams(base_url, model_dir, streams))
    finally:
        _stop(server)

    print(f"\n{'user':<8} {'streams':>7} {'tokens':>7} {'span s':>7} "
          f"{'tok/s':>8} {'limit':>6}")  # fmt: skip
    for user, rate in sorted(rates_by_user(results).items()):
        limit = USER_RATES.get(user, DEFAULT_RATE)
        print(
            f"{user:<8} {STREAMS[user]:>7} {rate.tokens:>7} {rate.span_s:>7.2f} "
            f"{rate.tokens_per_s:>8.2f} {limit:>6}"
        )
    incomplete = [r for r in results if r.completion_tokens != args.tokens]
    print(
        "\nall streams complete" if not incomplete else f"{len(incomplete)} cut short"
    )
    return 1 if incomplete else 0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_healthy(
    server: subprocess.Popen, base_url: str, log_path: Path, timeout_s: float = 420
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            tail = log_path.read_text(errors="replace")[-4000:]
            raise SystemExit(f"server exited at start-up:\n{tail}")
        try:
            if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit(f"server not healthy after {timeout_s:.0f} s")


def _stop(server: subprocess.Popen) -> None:
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGINT)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    print("server stopped")


if __name__ == "__main__":
    sys.exit(main())
