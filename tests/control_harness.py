"""Test doubles and helpers for the control-plane tests: a shared limiter over
real limiter and accounting objects and a fake clock, and real in-process
servers."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from control.server import ControlServer, TlsConfig, create_server
from control.service.operations import LimitsService
from pacing.accounting import Accounting
from pacing.limiter import OutputRateLimiter
from pacing.modes import Mode
from pacing.policy.document import Document, parse
from pacing.policy.flat import tree_of
from pacing.policy.model import Policy
from pacing.shared import RequestCounts, SharedLimiter
from pacing.teams import Teams, TeamTable
from protos.outputrate.v1 import output_rate_pb2_grpc
from tools.fake_clock import FakeClock

NS_PER_S = 1_000_000_000

#: The one rule's words for a bad rate (a prompt rate's included).
PROMPT_RATE_RULE = "must be an integer in 1..1000000 (tokens per second), got"
#: Prompt rates on every holder, in the object form, beside a user in the
#: number form.
PROMPT_RATES_DOC = {
    "default_tokens_per_second": 10,
    "default": {"prompt_tokens_per_second": 3000},
    "tiers": {"free": {"tokens_per_second": 5, "prompt_tokens_per_second": 200}},
    "teams": {"acme": {"tokens_per_second": 600, "prompt_tokens_per_second": 4000}},
    "users": {
        "p": {"tokens_per_second": 1000, "prompt_tokens_per_second": 1500},
        "q": 1000,
        "m": {"tier": "free", "team": "acme"},
    },
}


class Counts:
    """A settable ``request_counts`` callable."""

    def __init__(self) -> None:
        self.value: dict[str, tuple[int, int]] = {}

    def __call__(self) -> RequestCounts:
        return dict(self.value)


@dataclass
class Rig:
    """A shared limiter over a real limiter and accounting, driven by a fake clock."""

    clock: FakeClock
    counts: Counts
    shared: SharedLimiter
    wakes: list[int]

    @property
    def limiter(self) -> OutputRateLimiter:
        return self.shared.limiter

    @property
    def accounting(self) -> Accounting:
        return self.shared.accounting

    def step(self, user: str, tokens: int = 1) -> int:
        """Acts as the scheduler: under the lock, tries ``tokens`` tokens for
        ``user`` at the current time, counting as the scheduler does; returns
        how many were granted."""
        granted = 0
        with self.shared.lock:
            now = self.clock()
            for _ in range(tokens):
                if self.limiter.try_take(user, now):
                    self.accounting.record(user, "charged")
                    granted += 1
                else:
                    self.accounting.record(user, "throttled_skips")
            self.shared.on_step(now)
        return granted


def make_rig(
    default_rate: int | None = 10,
    user_rates: Mapping[str, int] | None = None,
    *,
    teams: TeamTable | None = None,
) -> Rig:
    """A shared limiter with these flags' table (``teams``: the flags' teams)."""
    clock = FakeClock()
    counts = Counts()
    wakes: list[int] = []
    limiter = OutputRateLimiter(default_rate, dict(user_rates or {}))
    held_teams = Teams(burst_ns=limiter.burst_ns)
    if teams is not None:
        held_teams.replace(teams, clock())
    shared = SharedLimiter(
        limiter,
        Accounting(),
        clock,
        counts,
        wake=lambda: wakes.append(clock()),
        teams=held_teams,
    )
    return Rig(clock, counts, shared, wakes)


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


def table(
    default_rate: int | None = None,
    user_rates: Mapping[str, int] | None = None,
    *,
    mode: Mode | None = None,
    fair_share: bool | None = None,
    **pieces: Any,
) -> Policy:
    """The policy of these flat pieces (``pacing.policy.flat``), checked by the
    one validator; ``mode`` and ``fair_share`` as given (``False`` kept)."""
    tree = tree_of({"default_rate": default_rate, "user_rates": user_rates, **pieces})
    policy = parse(tree).policy
    return dataclasses.replace(policy, mode=mode, fair_share=fair_share)


@dataclass(frozen=True)
class Pieces:
    """A policy's flat pieces, for assertions about one of them."""

    default_rate: int | None
    user_rates: dict[str, int]
    tier_rates: dict[str, int]
    exempt_tiers: frozenset[str]
    memberships: dict[str, str]
    exempt_users: frozenset[str]
    user_weights: dict[str, float]
    tier_weights: dict[str, float]
    team_rates: dict[str, int]
    team_members: dict[str, str]
    team_weights: dict[str, float]
    mode: Mode | None
    fair_share: bool | None
    users: frozenset[str]


def pieces(of: Policy | Document | None) -> Pieces:
    """The flat pieces of a policy (or of a document's)."""
    assert of is not None
    policy = of.policy if isinstance(of, Document) else of
    limits, teams, share = (
        policy.limit_table(),
        policy.team_table(),
        policy.share_policy(),
    )
    return Pieces(
        policy.default_rate,
        limits.user_rates,
        limits.tier_rates,
        frozenset(limits.exempt_tiers),
        limits.memberships,
        frozenset(limits.exempt_users),
        dict(share.users),
        dict(share.tiers),
        dict(teams.rates),
        dict(teams.memberships),
        dict(share.teams),
        policy.mode,
        policy.fair_share,
        frozenset(policy.users),
    )
