"""The seed article's measurement (README, "Benchmarks"), side by side in one run, on
a real local vLLM server: per-user rates against limits, an unthrottled user's speed
alone and beside a throttled one, engine-core CPU while every user is parked, and
(with ``--compare-upstream``) unthrottled throughput with pacing on vs off.

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
from tools.measure import bracketed, most_tokens, rates_by_user, run_streams
from tools.tiny_model import ensure_tiny_model

LIMITS = {"user-a": 20, "user-b": 100, "user-parked": 2}
DEFAULT_RATE = 100_000  # high enough never to trigger for user-c
TOKENS = 200


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default=None, help="default: tiny model")
    parser.add_argument(
        "--server-arg", action="append", default=[], help="extra vLLM flag"
    )
    parser.add_argument("--compare-upstream", action="store_true")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="output-rate-bench-"))
    model_dir = args.model_dir or str(ensure_tiny_model(workdir / "model"))
    pacing = [
        "--default-user-output-tokens-per-second",
        str(DEFAULT_RATE),
        "--user-output-tokens-per-second",
        json.dumps(LIMITS),
    ]
    results: dict = {"server_args": args.server_arg}
    server = start_server(model_dir, workdir / "paced.log", pacing + args.server_arg)
    try:
        results.update(asyncio.run(_paced_scenarios(server)))
        results["engine_core_cpu_parked"] = _parked_cpu(server)
        if args.compare_upstream:
            results["throughput_paced"] = asyncio.run(_throughput(server))
    finally:
        server.stop()
    scheduler_line = next(
        (
            line
            for line in server.log_path.read_text().splitlines()
            if "pacing on" in line
        ),
        "",
    )
    results["scheduler"] = scheduler_line.split("(")[-1].split(")")[0]
    if args.compare_upstream:
        upstream = start_server(model_dir, workdir / "upstream.log", args.server_arg)
        try:
            results["throughput_upstream"] = asyncio.run(_throughput(upstream))
        finally:
            upstream.stop()
    _report(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


async def _paced_scenarios(server: VllmServer) -> dict:
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

    async def throttled_a() -> None:
        # 40 s at 20 tok/s: outlasts user-c's measurement; bracketed cancels it.
        await run_streams(server.base_url, server.model, [("user-a", TOKENS)] * 4)

    c = await bracketed(lambda: _c_request_rate(server), throttled_a, 7, 0.3)
    out["c_solo_tok_s"] = c.alone
    out["c_beside_a_tok_s"] = c.beside
    out["c_ratio"] = c.ratio
    return out


async def _c_request_rate(server: VllmServer) -> float:
    (result,) = await run_streams(server.base_url, server.model, [("user-c", TOKENS)])
    return result.request_tokens_per_s


def _parked_cpu(server: VllmServer, seconds: float = 10.0) -> dict:
    """Engine-core CPU share while the only streams belong to a 2 tok/s user."""
    pid = server.engine_core_pid()

    async def parked() -> None:
        await run_streams(server.base_url, server.model, [("user-parked", 30)] * 4)

    async def measure() -> float:
        task = asyncio.create_task(parked())
        await asyncio.sleep(2)  # past the burst: every stream is parked
        before, started = process_cpu_seconds(pid), time.monotonic()
        await asyncio.sleep(seconds)
        share = (process_cpu_seconds(pid) - before) / (time.monotonic() - started)
        task.cancel()
        return share

    return {"pid": pid, "seconds": seconds, "cpu_share": asyncio.run(measure())}


async def _throughput(server: VllmServer) -> float:
    started = time.monotonic()
    results = await run_streams(
        server.base_url, server.model, [("user-c", TOKENS)] * 16
    )
    return sum(r.completion_tokens for r in results) / (time.monotonic() - started)


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
    if "throughput_upstream" in results:
        paced, upstream = results["throughput_paced"], results["throughput_upstream"]
        ratio = statistics.median(paced) / statistics.median(upstream)
        print(
            f"16 unthrottled streams, tok/s per run: paced {[round(r) for r in paced]}"
            f", upstream {[round(r) for r in upstream]} (ratio of medians {ratio:.3f};"
            " one server each, so machine drift between them is not cancelled)"
        )


if __name__ == "__main__":
    main()
