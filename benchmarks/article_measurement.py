"""The seed article's measurement (docs/benchmarks.md), side by side in one run, on
a real local vLLM server: per-user rates against limits, an unthrottled user's speed
alone and beside a throttled one, and engine-core CPU while every user is parked.
The comparison with a stock server is ``benchmarks.compare_stock``, which reuses
``isolation`` and ``engine_core_cpu`` from here.

``python -m benchmarks.article_measurement [--server-arg=--async-scheduling]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

from tools.local_server import VllmServer, process_cpu_seconds, start_server
from tools.measure import (
    Bracketed,
    bracketed,
    most_tokens,
    rates_by_user,
    run_streams,
)
from tools.tiny_model import ensure_tiny_model

LIMITS = {"user-a": 20, "user-b": 100, "user-parked": 2}
DEFAULT_RATE = 100_000  # high enough never to trigger for user-c
TOKENS = 200
#: The parked load: this many streams of ``user-parked``.
PARKED_STREAMS = 4
#: One measurement of user-c: this many requests of ``C_TOKENS``, one after the
#: other (about 3 s with the tiny model here). A single 200-token request lasts
#: 0.3 s, so one scheduling hiccup of a shared machine moved its rate by 10 %.
C_REQUESTS = 4
C_TOKENS = 400


def pacing_args(limits: dict[str, int]) -> list[str]:
    """Server flags: ``limits`` per user, everyone else ``DEFAULT_RATE``."""
    return [
        "--default-user-output-tokens-per-second",
        str(DEFAULT_RATE),
        "--user-output-tokens-per-second",
        json.dumps(limits),
    ]


def scheduler_class(server: VllmServer) -> str:
    """The scheduler class named in the server's 'pacing on' log line; empty when
    that line is missing (pacing off, or the plugin not loaded)."""
    line = next(
        (
            line
            for line in server.log_path.read_text().splitlines()
            if "per-user output pacing on" in line
        ),
        "",
    )
    return line.split("(")[-1].split(")")[0] if line else ""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default=None, help="default: tiny model")
    parser.add_argument(
        "--server-arg", action="append", default=[], help="extra vLLM flag"
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="output-rate-bench-"))
    model_dir = args.model_dir or str(ensure_tiny_model(workdir / "model"))
    results: dict = {"server_args": args.server_arg}
    server = start_server(
        model_dir, workdir / "paced.log", pacing_args(LIMITS) + args.server_arg
    )
    try:
        results.update(asyncio.run(_rate_scenarios(server)))
        c = asyncio.run(isolation(server))
        results["c_solo_tok_s"] = c.alone
        results["c_beside_a_tok_s"] = c.beside
        results["c_ratio"] = c.ratio
        results["engine_core_cpu_parked"] = {
            "seconds": 10.0,
            "cpu_share": asyncio.run(engine_core_cpu(server, "user-parked", 10.0)),
        }
    finally:
        server.stop()
    results["scheduler"] = scheduler_class(server)
    _report(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


async def _rate_scenarios(server: VllmServer) -> dict:
    out: dict = {}
    for a_streams in (1, 4):
        streams = [("user-a", TOKENS)] * a_streams + [("user-b", TOKENS)]
        rates = rates_by_user(await run_streams(server.base_url, server.model, streams))
        out[f"a{a_streams}"] = {
            user: {
                "tokens": r.tokens,
                "span_s": r.span_s,
                "tok_s": r.tokens_per_s,
                "window_s": r.window_s,
                "window_tok_s": r.window_tokens_per_s,
                # GCRA's ceiling over the window from sending, which holds every
                # charge (the first-to-last span may not: see tools.measure).
                "most_tokens": most_tokens([(0.0, LIMITS[user])], r.window_s),
            }
            for user, r in rates.items()
        }
    return out


async def isolation(server: VllmServer, cycles: int = 7) -> Bracketed:
    """user-c's tok/s (``_c_rate``) alone and beside user-a's 4 throttled
    streams (20 tok/s), each run beside the load bracketed by runs alone."""

    async def throttled_a() -> None:
        # 40 s at 20 tok/s: outlasts user-c's measurement; bracketed cancels it.
        await run_streams(server.base_url, server.model, [("user-a", TOKENS)] * 4)

    return await bracketed(lambda: _c_rate(server), throttled_a, cycles, 0.3)


async def _c_rate(server: VllmServer) -> float:
    """user-c's tok/s over ``C_REQUESTS`` requests in a row: all their tokens
    over the time from sending the first to the end of the last (each
    request's first-token latency included, as its user sees it)."""
    started = time.monotonic()
    for _ in range(C_REQUESTS):
        (result,) = await run_streams(
            server.base_url, server.model, [("user-c", C_TOKENS)]
        )
        if result.completion_tokens != C_TOKENS:
            raise RuntimeError(
                f"user-c got {result.completion_tokens} of {C_TOKENS} tokens"
            )
    return C_REQUESTS * C_TOKENS / (time.monotonic() - started)


async def engine_core_cpu(
    server: VllmServer,
    user: str,
    seconds: float,
    streams: int = PARKED_STREAMS,
    tokens: int = TOKENS,
    settle_s: float = 2.0,
) -> float:
    """The engine core's CPU share (1.0 = one core) over ``seconds`` while
    ``streams`` streams of ``user`` run, each started again when it ends (a user
    limited to a few tok/s holds them parked; an unlimited one generates flat
    out). Measured from ``settle_s`` after the streams start: past the burst."""
    pid = server.engine_core_pid()
    if pid is None:
        raise RuntimeError("no engine-core process found under the server")

    async def one_stream() -> None:
        while True:
            await run_streams(server.base_url, server.model, [(user, tokens)])

    tasks = [asyncio.ensure_future(one_stream()) for _ in range(streams)]
    try:
        await asyncio.sleep(settle_s)
        before, started = process_cpu_seconds(pid), time.monotonic()
        await asyncio.sleep(seconds)
        return (process_cpu_seconds(pid) - before) / (time.monotonic() - started)
    finally:
        for task in tasks:
            task.cancel()
        for outcome in await asyncio.gather(*tasks, return_exceptions=True):
            if not isinstance(outcome, asyncio.CancelledError):
                raise RuntimeError(f"a stream of the load failed: {outcome!r}")


def _report(results: dict) -> None:
    print(f"\nscheduler: {results['scheduler']}  extra flags: {results['server_args']}")
    for scenario in ("a1", "a4"):
        for user, r in sorted(results[scenario].items()):
            limit = LIMITS[user]
            print(
                f"{scenario} {user:<7} {r['tokens']:>4} tokens in {r['span_s']:6.2f} s"
                f" = {r['tok_s']:7.2f} tok/s (limit {limit}); from sending "
                f"{r['window_s']:6.2f} s = {r['window_tok_s']:7.2f} tok/s, GCRA "
                f"allows {r['most_tokens']:.1f}"
            )
    print(
        f"user-c alone {statistics.median(results['c_solo_tok_s']):.1f} tok/s, beside "
        f"throttled A {statistics.median(results['c_beside_a_tok_s']):.1f} tok/s "
        f"(median of bracketed ratios {results['c_ratio']:.3f})"
    )
    cpu = results["engine_core_cpu_parked"]
    print(
        f"engine-core CPU with every stream parked: {100 * cpu['cpu_share']:.1f} % "
        f"of a core over {cpu['seconds']:.0f} s"
    )


if __name__ == "__main__":
    main()
