"""With a global store, a user's state read from one engine shows the global TAT
and that engine's balance (``UserState.store``): a real gRPC server over a
shared limiter whose budget is the real ``StoreBudget``, filled by the real
claimer from ``fakeredis`` and from a real ``redis-server``. The engines'
clocks are fake; passes run one at a time."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator

import pytest

from control.cli.main import main
from control.service.operations import LimitsService
from pacing.claims import ClaimedBalances
from pacing.limiter import OutputRateLimiter
from pacing.settings.store import FailureMode
from pacing.store_budget import DEGRADED_AFTER_NS, StoreBudget
from protos.outputrate.v1 import output_rate_pb2 as pb
from store.claimer import Claimer
from store.clients import connect
from store.redis_store import RedisStore
from tests import store_harness
from tests.control_harness import NS_PER_S, Rig, Served, make_rig, serving
from tools.fake_clock import FakeClock

client = store_harness.client
redis_url = store_harness.redis_url

MS = 1_000_000
FAILURE_AFTER_NS = 2 * NS_PER_S


class Engine:
    """The served engine: the control harness's shared limiter (alice limited
    to 1 token/s, everyone else to 10) spending from a ``StoreBudget``."""

    def __init__(
        self, store: RedisStore, mode: FailureMode = FailureMode.KEEP_LOCAL_SHARE
    ) -> None:
        self.rig: Rig = make_rig(10, {"alice": 1})
        shared = self.rig.shared
        # One engine, stated (--output-rate-store-expected-engines 1): the
        # health below is that of an engine whose local share is known.
        self.balances = ClaimedBalances(shared.limiter, assumed_engines=1)
        self.budget = StoreBudget(
            self.balances,
            shared.limiter,
            self.rig.clock,
            failure_mode=mode,
            failure_after_ns=FAILURE_AFTER_NS,
        )
        with shared.lock:
            shared.use_budget(self.budget)
        self.claimer = self.claimer_on(store)

    def claimer_on(self, store: RedisStore) -> Claimer:
        shared = self.rig.shared
        return Claimer(
            store, self.balances, shared.lock, self.rig.clock, engine_id="served"
        )

    @property
    def clock(self) -> FakeClock:
        return self.rig.clock

    def take(self, user: str, most: int) -> int:
        """Acts as the scheduler's step for a request of ``user``'s (resident
        from then on): spends from the budget under the lock."""
        self.rig.counts.value.setdefault(user, (1, 0))
        with self.rig.shared.lock:
            return self.budget.take_up_to(user, most, self.clock())[0]


class Other:
    """Another engine on the same store: balances and a claimer, no server."""

    def __init__(self, store: RedisStore) -> None:
        self.clock = FakeClock()
        self.lock = threading.Lock()
        self.balances = ClaimedBalances(OutputRateLimiter(10, {"alice": 1}))
        self.claimer = Claimer(
            store, self.balances, self.lock, self.clock, engine_id="other"
        )

    def claim(self, user: str) -> int:
        """Asks for a token, claims, and returns what it holds then."""
        with self.lock:
            self.balances.take_up_to(user, 0, self.clock())
        self.claimer.run_once()
        return self.balances.held(user, self.clock())


@pytest.fixture
def store(client) -> RedisStore:
    return RedisStore(client)


@pytest.fixture
def engine(store) -> Engine:
    return Engine(store)


@pytest.fixture
def served(engine) -> Iterator[Served]:
    with serving(LimitsService(engine.rig.shared)) as served:
        yield served


def state_of(served: Served, user: str) -> pb.UserState:
    return served.stub.GetUserState(pb.GetUserStateRequest(name=f"userStates/{user}"))


def view(state: pb.UserState) -> tuple[int, int, int | None, str]:
    """``state.store`` as (held, global TAT lead ns, read age ns or None,
    health)."""
    store = state.store
    age = store.global_tat_read_age
    return (
        store.held_tokens,
        store.global_tat_lead.ToNanoseconds(),
        age.ToNanoseconds() if store.HasField("global_tat_read_age") else None,
        pb.StoreView.Health.Name(store.health),
    )


def test_user_state_shows_the_global_tat_and_this_engines_balance(
    store, engine, served
):
    """Alice may have 1 token/s, a burst of 1, across every engine."""
    other = Other(store)
    assert other.claim("alice") == 1  # the other engine holds her only token
    assert engine.take("alice", 1) == 0  # so this engine's claim gets none
    engine.claimer.run_once()
    held, lead, age, health = view(state_of(served, "alice"))
    # The cell's TAT runs ahead for the other engine's token, not for one here.
    assert (held, age, health) == (0, 0, "GLOBAL")
    assert 0 < lead <= NS_PER_S
    with other.lock:  # her last request there ends: the token goes back
        other.balances.end_user("alice", other.clock())
    other.claimer.run_once()
    engine.clock.advance_ms(1000)  # past the wait the store gave this engine
    assert engine.take("alice", 1) == 0  # its next step: still nothing
    engine.claimer.run_once()
    # The cell was full: the one token granted puts its TAT one interval ahead.
    assert view(state_of(served, "alice")) == (1, NS_PER_S, 0, "GLOBAL")
    engine.clock.advance_ms(250)
    assert view(state_of(served, "alice")) == (1, 750 * MS, 250 * MS, "GLOBAL")
    assert engine.take("alice", 1) == 1
    assert view(state_of(served, "alice"))[0] == 0  # spent


def test_every_listed_and_watched_state_carries_the_store_view(engine, served):
    assert engine.take("bob", 1) == 0
    engine.claimer.run_once()  # bob: 1 of a burst of 2 at 10 tok/s
    listed = served.stub.ListUserStates(pb.ListUserStatesRequest()).user_states
    assert [(s.user, view(s)) for s in listed] == [
        ("alice", (0, 0, None, "GLOBAL")),  # known (a limit), never claimed for
        ("bob", (1, 100 * MS, 0, "GLOBAL")),
    ]
    watch = served.stub.WatchUserStates(
        pb.WatchUserStatesRequest(names=["userStates/bob"])
    )
    update = next(watch)
    watch.cancel()
    assert [view(s) for s in update.user_states] == [(1, 100 * MS, 0, "GLOBAL")]


def unused_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_user_state_shows_that_the_engine_is_degraded(store):
    """The store stops answering (the claimer's next store refuses
    connections): the reading ages, the health moves from the local share to
    the failure mode."""
    engine = Engine(store, FailureMode.FAIL_CLOSED)
    with serving(LimitsService(engine.rig.shared)) as served:
        engine.take("bob", 1)
        engine.claimer.run_once()
        engine.clock.advance_ms(100)
        engine.take("bob", 1)
        dead = RedisStore(connect(f"redis://127.0.0.1:{unused_port()}/0"))
        engine.claimer_on(dead).run_once()
        assert engine.balances.store_down_since_ns == engine.clock()
        assert view(state_of(served, "bob")) == (0, 0, 100 * MS, "GLOBAL")
        engine.clock.advance_ms(DEGRADED_AFTER_NS // MS)
        assert view(state_of(served, "bob"))[2:] == (
            100 * MS + DEGRADED_AFTER_NS,
            "LOCAL_SHARE",
        )
        engine.clock.advance_ms((FAILURE_AFTER_NS - DEGRADED_AFTER_NS) // MS)
        assert view(state_of(served, "bob"))[3] == "FAIL_CLOSED"


def test_without_a_store_the_state_has_no_store_view(capsys):
    rig = make_rig(10, {"alice": 1})
    with serving(LimitsService(rig.shared)) as served:
        assert not state_of(served, "alice").HasField("store")
        assert main(["--address", served.address, "--json", "state", "alice"]) == 0
        assert json.loads(capsys.readouterr().out)["store"] is None
        assert main(["--address", served.address, "state", "alice"]) == 0
    header = capsys.readouterr().out.splitlines()[1].split()
    assert "HELD" not in header


def test_output_rate_ctl_shows_the_store_view(engine, served, capsys):
    engine.take("bob", 1)
    engine.claimer.run_once()
    engine.clock.advance_ms(40)
    assert main(["--address", served.address, "--json", "state", "bob"]) == 0
    assert json.loads(capsys.readouterr().out)["store"] == {
        "held_tokens": 1,
        "global_tat_lead_s": 0.06,
        "global_tat_read_age_s": 0.04,
        "health": "global",
    }
    assert main(["--address", served.address, "state"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[-4:] == ["HELD", "GLOBAL_TAT", "READ_AGO", "STORE"]
    rows = {line.split()[0]: line.split()[-4:] for line in lines[2:]}
    assert rows == {
        "alice": ["0", "0ms", "-", "global"],
        "bob": ["1", "60ms", "40ms", "global"],
    }


def test_the_store_view_stays_while_a_ceiling_or_a_team_wraps_the_budget(
    engine, served
):
    """A ceiling puts the borrowing budget over the store's, a team the teams'
    budget over that: the state still shows the store's view, and the ceiling."""
    assert engine.take("bob", 1) == 0
    engine.claimer.run_once()
    stub = served.stub
    stub.UpdateLimit(
        pb.UpdateLimitRequest(
            limit=pb.Limit(name="limits/bob", ceiling_tokens_per_second=30),
            allow_missing=True,
        )
    )
    state = state_of(served, "bob")
    assert view(state) == (1, 100 * MS, 0, "GLOBAL")
    assert (state.ceiling_tokens_per_second, state.may_borrow) == (30, True)
    stub.CreateTeam(
        pb.CreateTeamRequest(team_id="acme", team=pb.Team(tokens_per_second=60))
    )
    assert view(state_of(served, "bob")) == (1, 100 * MS, 0, "GLOBAL")
