"""Client-side measurement of per-user output rates against an OpenAI-compatible
server: concurrent streams, exact token counts from ``continuous_usage_stats``,
rate = tokens over the span from a user's first to last token (the seed article's
definition), and the limiter's ceiling over a window the client knows holds every
charge.

Which window proves what. A token reaches the client some time after the server
charged it, and that delay varies (a busy client or machine). A late first token
makes the first-to-last span shorter than the span over which the server charged
the tokens, so that span cannot prove a ceiling; a late last token makes it longer,
so on a loaded machine it cannot prove a floor either (the floor is measured on the
server's counters: ``tools.server_counters``). The window from the
user's first request being sent to its last token surely holds every charge (the
scheduler charges a token in a step it schedules after the request reached it, and
the token leaves after that), so GCRA's ceiling over it holds whatever the delays:
that window serves the ceiling.
"""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import httpx

from pacing.identity import USER_FIELD
from pacing.limiter import DEFAULT_BURST_NS

#: The server's GCRA burst (delay variation tolerance) in seconds.
BURST_S = DEFAULT_BURST_NS / 1e9


@dataclass
class StreamResult:
    """One streamed completion: when each token arrived (monotonic seconds)."""

    user: str | None
    token_times: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    finish_reason: str | None = None
    started_at: float = 0.0  #: just before the request's first byte was sent
    finished_at: float = 0.0  #: when the stream ended

    @property
    def request_tokens_per_s(self) -> float:
        """Tokens over the whole request (first token latency included): robust
        for fast streams, whose tokens may reach the client in bunches."""
        return self.completion_tokens / (self.finished_at - self.started_at)


@dataclass(frozen=True)
class UserRate:
    user: str | None
    tokens: int  #: N: tokens over all of the user's streams
    span_s: float  #: W: first to last token of the user, in seconds
    #: From the user's first request being sent to its last token, in seconds:
    #: every one of the N tokens was charged inside it.
    window_s: float

    @property
    def tokens_per_s(self) -> float:
        """N over the first-to-last span (the seed article's definition of a rate)."""
        return self.tokens / self.span_s if self.span_s > 0 else float("inf")

    @property
    def window_tokens_per_s(self) -> float:
        """N over the window from the first request being sent."""
        return self.tokens / self.window_s


async def stream_completion(
    client: httpx.AsyncClient,
    model: str,
    user: str | None,
    max_tokens: int,
    prompt: str = "hello world",
    temperature: float | None = None,
) -> StreamResult:
    """Streams one ``/v1/completions`` request with ``ignore_eos`` and records the
    arrival time of every token (``temperature``: the server's default if None)."""
    body: dict = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    if user is not None:
        body["vllm_xargs"] = {USER_FIELD: user}
    if temperature is not None:
        body["temperature"] = temperature
    return await record_stream(client, "/v1/completions", body, user)


async def record_stream(
    client: httpx.AsyncClient, path: str, body: dict, user: str | None
) -> StreamResult:
    """POSTs a streaming ``body`` (with ``continuous_usage_stats``) to ``path``
    and records the arrival time of every token; an error chunk raises with the
    server's message."""
    result = StreamResult(user=user, started_at=time.monotonic())
    async with client.stream("POST", path, json=body) as response:
        response.raise_for_status()
        async for data in _sse_data(response):
            now = time.monotonic()
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"the stream failed: {chunk['error']}")
            usage = chunk.get("usage") or {}
            count = usage.get("completion_tokens", result.completion_tokens)
            result.token_times.extend([now] * (count - result.completion_tokens))
            result.completion_tokens = count
            for choice in chunk.get("choices") or []:
                result.finish_reason = (
                    choice.get("finish_reason") or result.finish_reason
                )
    result.finished_at = time.monotonic()
    return result


async def _sse_data(response: httpx.Response):
    """Yields the ``data:`` payloads of a server-sent event stream.

    Splits on ``\n`` only: generated text may hold characters that
    ``str.splitlines`` (and so ``aiter_lines``) treats as line breaks.
    """
    buffer = b""
    async for raw in response.aiter_bytes():
        buffer += raw
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                yield line[len(b"data: ") :].decode()


async def run_streams(
    base_url: str,
    model: str,
    streams: Sequence[tuple[str | None, int]],
    timeout_s: float = 300.0,
    temperature: float | None = None,
) -> list[StreamResult]:
    """Runs one stream per ``(user, max_tokens)`` entry, all at once."""
    limits = httpx.Limits(max_connections=len(streams) + 4)
    async with httpx.AsyncClient(
        base_url=base_url, timeout=timeout_s, limits=limits
    ) as client:
        return await asyncio.gather(
            *(
                stream_completion(client, model, user, n, temperature=temperature)
                for user, n in streams
            )
        )


def rates_by_user(results: Sequence[StreamResult]) -> dict[str | None, UserRate]:
    """Per user: N tokens, the span W from its first to its last token, and the
    window from its first request being sent to its last token."""
    times: dict[str | None, list[float]] = {}
    sent: dict[str | None, float] = {}
    for result in results:
        times.setdefault(result.user, []).extend(result.token_times)
        sent[result.user] = min(sent.get(result.user, math.inf), result.started_at)
    return {
        user: UserRate(
            user=user,
            tokens=len(ts),
            span_s=max(ts) - min(ts),
            window_s=max(ts) - sent[user],
        )
        for user, ts in times.items()
        if ts
    }


def most_tokens(limits: Sequence[tuple[float, int]], until: float) -> float:
    """GCRA's ceiling on the tokens one user can be charged from ``limits[0][0]``
    to ``until``, where the limit is ``limits[i][1]`` tok/s from ``limits[i][0]``
    on (``limits`` in time order, times in seconds).

    The ceiling is the tokens earned over the time, plus the burst at the limit in
    force when the last token was charged, plus one (a limit change keeps the
    user's token debt, so it grants no fresh burst). Where that last charge fell is
    not known, so the largest value over every place is taken. With one limit it is
    the limiter's guarantee ``(W + burst) * limit + 1`` (docs/concepts/pacing.md).
    """
    earned, ceiling = 0.0, -math.inf
    for i, (start, rate) in enumerate(limits):
        if i > 0 and start > until:
            break
        end = min(limits[i + 1][0], until) if i + 1 < len(limits) else until
        earned += rate * max(0.0, end - start)
        ceiling = max(ceiling, earned + BURST_S * rate)
    return ceiling + 1


@dataclass(frozen=True)
class Bracketed:
    """A quantity measured alone and beside some load, run by run."""

    alone: list[float]  #: one more than ``beside``: before, between, after
    beside: list[float]

    @property
    def ratios(self) -> list[float]:
        """Each run beside the load over the mean of the runs alone just before
        and after it: drift of a shared machine cancels."""
        return [
            value / ((self.alone[k] + self.alone[k + 1]) / 2)
            for k, value in enumerate(self.beside)
        ]

    @property
    def ratio(self) -> float:
        """The median of ``ratios``: one slow run does not decide."""
        return statistics.median(self.ratios)


async def bracketed(
    measure: Callable[[], Awaitable[float]],
    load: Callable[[], Awaitable[object]],
    cycles: int,
    settle_s: float,
) -> Bracketed:
    """Runs ``measure`` alone, then ``cycles`` times: starts ``load``, waits
    ``settle_s``, runs ``measure`` beside it, cancels the load, runs ``measure``
    alone again. Raises if a load ends before its measurement does.

    Make the load outlast any measurement, however slow the machine: it is
    cancelled once its measurement is done, so its length costs nothing."""
    await measure()  # warm-up, not kept
    alone, beside = [await measure()], []
    for _ in range(cycles):
        task = asyncio.ensure_future(load())
        try:
            await asyncio.sleep(settle_s)
            beside.append(await measure())
            if task.done():
                task.result()  # the load's own error, if it failed
                raise RuntimeError("the load ended before the measurement beside it")
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        alone.append(await measure())
    return Bracketed(alone=alone, beside=beside)


def assert_at_most_gcra(rate: UserRate, limit: float) -> None:
    """At most GCRA's bound over the window from the first request sent to the
    last token at the client, which holds every charge however late tokens
    reach the client. (The floor is measured on the server's counters:
    ``tools.server_counters``.) Prints what it compared."""
    ceiling = most_tokens([(0.0, limit)], rate.window_s)
    report = (
        f"{rate.user}: {rate.tokens} tokens; first to last {rate.span_s:.3f} s = "
        f"{rate.tokens_per_s:.2f} tok/s; sent to last {rate.window_s:.3f} s "
        f"(at most {ceiling:.1f} allowed); limit {limit}"
    )
    print(f"\n{report}")
    assert rate.tokens <= ceiling, report


def max_over_gcra_bound_scaled(
    times_ns: Sequence[int], rate: int, burst_ns: int = DEFAULT_BURST_NS
) -> int:
    """The largest excess over GCRA's bound of tokens dated ``times_ns``
    (sorted): max over windows [t_i, t_j] of count - (W + burst)·R - 1, in
    tokens times 1e9 (integer ns arithmetic); <= 0 iff every window is within
    the bound. With g(k) = k·1e9 - t_k·R a window's excess is
    g(j) - g(i) - burst·R, so one pass with the running minimum of g finds the
    worst."""
    burst = burst_ns * rate
    worst = -burst
    lowest = None
    for k, t in enumerate(times_ns):
        g = k * 10**9 - t * rate
        lowest = g if lowest is None else min(lowest, g)
        worst = max(worst, g - lowest - burst)
    return worst
