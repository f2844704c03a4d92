"""The demo: a real vLLM server on the tiny local model with per-user limits,
several concurrent streams per user, measured tok/s printed beside each limit.

``python -m tools.demo [--model-dir DIR] [--tokens N]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path

from tools.local_server import start_server
from tools.measure import rates_by_user, run_streams
from tools.tiny_model import ensure_tiny_model

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
    log_path = Path(tempfile.mkdtemp(prefix="output-rate-demo-")) / "vllm.log"
    print(f"starting vLLM on the tiny model at {model_dir} (log: {log_path}) ...")
    server = start_server(
        model_dir,
        log_path,
        [
            "--default-user-output-tokens-per-second",
            str(DEFAULT_RATE),
            "--user-output-tokens-per-second",
            json.dumps(USER_RATES),
        ],
    )
    try:
        streams = [(u, args.tokens) for u, n in STREAMS.items() for _ in range(n)]
        print(f"server up; {len(streams)} streams of {args.tokens} tokens each ...")
        results = asyncio.run(run_streams(server.base_url, model_dir, streams))
    finally:
        server.stop()
        print("server stopped")

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


if __name__ == "__main__":
    sys.exit(main())
