"""Teams on vLLM's real Scheduler and AsyncScheduler (a fake clock, controlled
model outputs): each team's tokens and each member's stay within GCRA's bound
for their rates, a binding team is split among its members by weight whatever
their stream counts, a member capped below its part leaves the rest to the
others, and under saturation teams share the engine by team weight."""

from __future__ import annotations

import collections
import random

import pytest

from tools.measure import max_over_gcra_bound_scaled
from tools.scheduler_harness import SYNC_AND_ASYNC, driven_scheduler, make_request

STEP_MS = 5.0


class Streams:
    """Keeps each user with its number of streams in the engine (a finished
    request is replaced at once); records when each user's and each team's
    tokens were dispatched (the charge times; an exempt member's count for no
    team)."""

    def __init__(self, scheduler, driver, streams: dict[str, int], max_tokens: int):
        self.scheduler = scheduler
        self.driver = driver
        self.streams = dict(streams)
        self.max_tokens = max_tokens
        self.owner: dict[str, str] = {}
        self.live: collections.Counter[str] = collections.Counter()
        self.tokens: collections.Counter[str] = collections.Counter()
        self.times: dict[str, list[int]] = collections.defaultdict(list)
        self.team_times: dict[str, list[int]] = collections.defaultdict(list)
        self.teams = scheduler.output_rate_shared.teams
        for user, count in streams.items():
            self.open(user, count)

    def open(self, user: str, count: int) -> None:
        requests = [
            make_request(user, max_tokens=self.max_tokens) for _ in range(count)
        ]
        for request in requests:
            self.owner[request.request_id] = user
        self.live[user] += count
        self.driver.add(requests)

    def step(self) -> list[str]:
        now = self.driver.clock()
        sampled = self.driver.step_sampled(step_ms=STEP_MS)
        users = [self.owner[rid] for rid in sampled]
        self.tokens.update(users)
        for user in users:
            self.times[user].append(now)
            team = self.teams.table.team_of(user)
            if team is not None and self.scheduler.limiter.rate_of(user):
                self.team_times[team].append(now)
        for rid in self.driver.outputs[-1].finished_req_ids:
            user = self.owner.get(rid)
            if user is not None:
                self.live[user] -= 1
        for user, count in self.streams.items():
            if self.live[user] < count:
                self.open(user, count - self.live[user])
        return users

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.step()

    def rates(self, users, seconds: float) -> dict[str, float]:
        return {user: self.tokens[user] / seconds for user in users}


def _teams(teams: dict[str, int], members: dict[str, str], **extra) -> dict:
    return {"team_rates": teams, "team_members": members, **extra}


@SYNC_AND_ASYNC
def test_each_team_and_each_user_stay_within_gcra_bound_over_seeded_workloads(
    tiny_model_dir, async_scheduling
):
    """A seeded random workload of 10,000 steps (another seed for the async
    scheduler): three teams (rates 40, 90, 250), members with 1-6
    streams, own caps from 15 to far above, users without a team, one exempt
    member; streams come and go. Every window of
    every team's and every user's charge times holds at most
    ``(W + burst) * R + 1`` tokens, and nobody with streams starves."""
    for seed in (1,) if async_scheduling else (0,):
        rng = random.Random(seed)
        teams = {"t40": 40, "t90": 90, "t250": 250}
        members = {f"m{i}": rng.choice(list(teams)) for i in range(9)}
        user_rates = {u: rng.choice([15, 30, 60, 10_000]) for u in members}
        user_rates["loner"] = 50
        scheduler, driver = driven_scheduler(
            tiny_model_dir,
            async_scheduling,
            default_rate=10_000,
            user_rates=user_rates,
            max_num_seqs=24,
            output_rate=_teams(teams, members, exempt_users=["m8"]),
        )
        streams = {u: rng.randrange(1, 7) for u in members}
        streams["loner"] = 2
        streams["free"] = 1
        load = Streams(scheduler, driver, streams, max_tokens=rng.randrange(20, 200))
        for step in range(10_000):
            if step % 1_000 == 500:  # a member leaves or comes back
                user = rng.choice(list(members))
                load.streams[user] = 0 if load.streams[user] else rng.randrange(1, 7)
            load.step()
        exempt_tokens = len(load.times["m8"])
        for team, rate in teams.items():
            assert max_over_gcra_bound_scaled(load.team_times[team], rate) <= 0, (
                seed,
                team,
            )
        for user, rate in user_rates.items():
            if user == "m8":  # exempt
                continue
            assert max_over_gcra_bound_scaled(load.times[user], rate) <= 0, (
                seed,
                user,
            )
        assert exempt_tokens > 0
        # The exempt member is charged to no team: its team's cell saw only
        # the others' tokens.
        team8 = members["m8"]
        charged = scheduler.output_rate_shared.teams.charged[team8]
        assert charged == sum(
            len(load.times[u]) for u, t in members.items() if t == team8 and u != "m8"
        )
        for user in streams:
            if load.streams.get(user):
                assert load.tokens[user] > 0, (seed, user)


@SYNC_AND_ASYNC
def test_a_binding_team_is_split_by_weight_not_by_streams(
    tiny_model_dir, async_scheduling
):
    """Team acme at 60 tok/s; a has 1 stream, b 6, c 3, own caps far above:
    over 60 s the team gets 60 tok/s within GCRA's bound and each member
    20 tok/s within 10 %; after every step the members' virtual times are
    within the stated bound of each other (one token over the smallest
    weight)."""
    scheduler, driver = driven_scheduler(
        tiny_model_dir,
        async_scheduling,
        default_rate=10_000,
        max_num_seqs=16,
        output_rate=_teams({"acme": 60}, {"a": "acme", "b": "acme", "c": "acme"}),
    )
    load = Streams(scheduler, driver, {"a": 1, "b": 6, "c": 3}, max_tokens=100)
    load.run(200)  # past the first burst and the first admissions
    load.tokens.clear()
    gaps = []
    steps = 12_000  # 60 s
    for _ in range(steps):
        load.step()
        vt = load.teams.vt
        gaps.append(max(vt[u] for u in "abc") - min(vt[u] for u in "abc"))
    seconds = steps * STEP_MS / 1000
    rates = load.rates("abc", seconds)
    assert max_over_gcra_bound_scaled(load.team_times["acme"], 60) <= 0
    assert sum(rates.values()) == pytest.approx(60, rel=0.02)
    for user, rate in rates.items():
        assert rate == pytest.approx(20, rel=0.10), (user, rates)
    assert max(gaps) <= 1.0 + 1e-9, max(gaps)


@SYNC_AND_ASYNC
def test_a_member_capped_below_its_part_leaves_the_rest_to_the_others(
    tiny_model_dir, async_scheduling
):
    """The same team with a capped at 10 tok/s: a gets 10 and b, c 25 each
    (within 10 %): the team's rate is still all used."""
    scheduler, driver = driven_scheduler(
        tiny_model_dir,
        async_scheduling,
        default_rate=10_000,
        user_rates={"a": 10},
        max_num_seqs=16,
        output_rate=_teams({"acme": 60}, {"a": "acme", "b": "acme", "c": "acme"}),
    )
    load = Streams(scheduler, driver, {"a": 1, "b": 6, "c": 3}, max_tokens=100)
    load.run(200)
    load.tokens.clear()
    load.run(12_000)
    rates = load.rates("abc", 60.0)
    assert rates["a"] == pytest.approx(10, rel=0.10), rates
    assert rates["b"] == pytest.approx(25, rel=0.10), rates
    assert rates["c"] == pytest.approx(25, rel=0.10), rates


@SYNC_AND_ASYNC
def test_member_weights_split_a_binding_team(tiny_model_dir, async_scheduling):
    """Weights 1:2:3 inside a team of 120 tok/s, equal streams: 20, 40 and 60
    tok/s within 10 %."""
    scheduler, driver = driven_scheduler(
        tiny_model_dir,
        async_scheduling,
        default_rate=10_000,
        max_num_seqs=16,
        output_rate=_teams(
            {"acme": 120},
            {"a": "acme", "b": "acme", "c": "acme"},
            user_weights={"a": 1, "b": 2, "c": 3},
        ),
    )
    load = Streams(scheduler, driver, {"a": 4, "b": 4, "c": 4}, max_tokens=100)
    load.run(200)
    load.tokens.clear()
    load.run(8_000)
    rates = load.rates("abc", 40.0)
    for user, expected in {"a": 20, "b": 40, "c": 60}.items():
        assert rates[user] == pytest.approx(expected, rel=0.10), rates


@SYNC_AND_ASYNC
def test_shadow_mode_counts_what_the_team_would_refuse(
    tiny_model_dir, async_scheduling
):
    """In shadow mode a binding team refuses nothing: its members stream at
    the engine's pace and the refusals are counted as shadow skips."""
    scheduler, driver = driven_scheduler(
        tiny_model_dir,
        async_scheduling,
        default_rate=10_000,
        max_num_seqs=16,
        output_rate=_teams({"acme": 20}, {"a": "acme", "b": "acme"}, mode="shadow"),
    )
    load = Streams(scheduler, driver, {"a": 2, "b": 2}, max_tokens=100)
    load.run(2_000)  # 10 s
    assert load.tokens["a"] + load.tokens["b"] > 10 * 20 * 10
    skips = {u: scheduler.accounting.of(u).shadow_skips for u in "ab"}
    assert all(count > 0 for count in skips.values()), skips


@SYNC_AND_ASYNC
def test_teams_share_a_saturated_engine_by_team_weight(
    tiny_model_dir, async_scheduling
):
    """Fair share on, 8 slots, caps far above: team A (one user, 16 streams)
    and team B (four users, 4 streams each), equal team weights: each team
    gets 50 % of the tokens within 7 points and each of B's users 12.5 %
    within 5."""
    members = {"a1": "A", **{f"b{i}": "B" for i in range(4)}}
    scheduler, driver = driven_scheduler(
        tiny_model_dir,
        async_scheduling,
        default_rate=100_000,
        max_num_seqs=8,
        output_rate=_teams(
            {"A": 100_000, "B": 100_000},
            members,
            fair_share=True,
            fair_share_config={"hysteresis": 1024, "min_run_tokens": 16},
        ),
    )
    streams = {"a1": 16, **{f"b{i}": 4 for i in range(4)}}
    load = Streams(scheduler, driver, streams, max_tokens=300)
    load.run(300)
    load.tokens.clear()
    load.run(6_000)
    total = sum(load.tokens.values())
    share_a = load.tokens["a1"] / total
    assert share_a == pytest.approx(0.5, abs=0.07), load.tokens
    for i in range(4):
        share = load.tokens[f"b{i}"] / total
        assert share == pytest.approx(0.125, abs=0.05), load.tokens
