"""Test doubles and helpers for the control-plane tests: a fake clock, a limiter
host around real limiter and accounting objects, and real in-process servers."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import grpc

from control.host import LimiterHost, RequestCounts
from control.server import ControlServer, TlsConfig, create_server
from control.service import LimitsService
from engine_ext.accounting import Accounting
from engine_ext.limiter import OutputRateLimiter
from protos.outputrate.v1 import output_rate_pb2_grpc

NS_PER_S = 1_000_000_000
#: Start of the fake clock: far from 0, as a monotonic clock would be.
T0 = 1_000 * NS_PER_S


class FakeClock:
    """A monotonic nanosecond clock that moves only when told."""

    def __init__(self, now_ns: int = T0) -> None:
        self.now_ns = now_ns

    def __call__(self) -> int:
        return self.now_ns

    def advance(self, seconds: float) -> None:
        self.now_ns += round(seconds * NS_PER_S)


class Counts:
    """A settable ``request_counts`` callable."""

    def __init__(self) -> None:
        self.value: dict[str, tuple[int, int]] = {}

    def __call__(self) -> RequestCounts:
        return dict(self.value)


@dataclass
class Rig:
    """A host over a real limiter and accounting, driven by a fake clock."""

    clock: FakeClock
    counts: Counts
    host: LimiterHost
    wakes: list[int]

    @property
    def limiter(self) -> OutputRateLimiter:
        return self.host.limiter

    @property
    def accounting(self) -> Accounting:
        return self.host.accounting

    def step(self, user: str, tokens: int = 1) -> int:
        """Acts as the scheduler: under the lock, tries ``tokens`` tokens for
        ``user`` at the current time, counting as the scheduler does; returns
        how many were granted."""
        granted = 0
        with self.host.lock:
            now = self.clock()
            for _ in range(tokens):
                if self.limiter.try_take(user, now):
                    self.accounting.record(user, "charged")
                    granted += 1
                else:
                    self.accounting.record(user, "throttled_skips")
            self.host.on_step(now)
        return granted


def make_rig(
    default_rate: int | None = 10, user_rates: Mapping[str, int] | None = None
) -> Rig:
    clock = FakeClock()
    counts = Counts()
    wakes: list[int] = []
    host = LimiterHost(
        OutputRateLimiter(default_rate, dict(user_rates or {})),
        Accounting(),
        clock,
        counts,
        wake=lambda: wakes.append(clock()),
    )
    return Rig(clock, counts, host, wakes)


@dataclass
class Served:
    """A started server and a channel to it."""

    server: ControlServer
    port: int
    channel: grpc.Channel
    stub: output_rate_pb2_grpc.OutputRateControlStub

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@contextlib.contextmanager
def serving(
    service: LimitsService,
    *,
    address: str = "127.0.0.1:0",
    auth_token: str | None = None,
    tls: TlsConfig | None = None,
    channel_credentials: grpc.ChannelCredentials | None = None,
    **kwargs,
) -> Iterator[Served]:
    """Runs ``service`` on a real server on a free port, marked SERVING."""
    server, port = create_server(
        address, service, auth_token=auth_token, tls=tls, **kwargs
    )
    server.start()
    server.set_serving()
    target = f"localhost:{port}"
    channel = (
        grpc.insecure_channel(target)
        if channel_credentials is None
        else grpc.secure_channel(target, channel_credentials)
    )
    try:
        yield Served(
            server, port, channel, output_rate_pb2_grpc.OutputRateControlStub(channel)
        )
    finally:
        channel.close()
        server.stop(0).wait()
