"""Tests for ``engine_ext.scheduling.band_stats``: the waiting queue per band at
each step's start, and how long requests waited, for the metrics.

What must hold: while the policy has bands, a step start counts the startable
requests waiting per band (every band, zeros too) and settles the stays of
the requests that left the queue since the previous one, in the band they
were in: from the step start that first found a request (a preempted one:
the step before) to the last that found it. An ended request's stay is
settled at once and it leaves the count. Without bands nothing is kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from vllm.v1.request import RequestStatus

from engine_ext.scheduling.band_stats import BandStats
from pacing.bands import BandTable

S = 1_000_000_000
BANDS = ("interactive", "standard", "batch")
TABLE = BandTable(names=BANDS, default=1)


@dataclass
class FakeRequest:
    request_id: str
    band: int
    status: RequestStatus = RequestStatus.WAITING


class Queue:
    """The waiting queue ``BandStats`` reads, the bands table in force, and
    each request's band (``BandSteps.band_of``)."""

    def __init__(self) -> None:
        self.waiting: list[FakeRequest] = []
        self.table = TABLE
        self.stats = BandStats(
            SimpleNamespace(waiting=self.waiting),  # type: ignore[arg-type]
            lambda: self.table,
            lambda request: request.band,  # type: ignore[attr-defined]
        )

    def add(self, request_id: str, band: int, **kw) -> FakeRequest:
        request = FakeRequest(request_id, band, **kw)
        self.waiting.append(request)
        return request

    def start(self, request_id: str) -> None:
        self.waiting[:] = [r for r in self.waiting if r.request_id != request_id]


def test_a_step_start_counts_the_startable_requests_of_every_band() -> None:
    queue = Queue()
    queue.add("a", 0)
    queue.add("b", 0, status=RequestStatus.PREEMPTED)
    queue.add("c", 2)
    queue.add("kv", 2, status=RequestStatus.WAITING_FOR_REMOTE_KVS)
    queue.add("fsm", 1, status=RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR)
    queue.stats.step_start(S)
    assert queue.stats.queued == {"interactive": 2, "standard": 0, "batch": 1}
    assert queue.stats.wait_ns == {}


def test_a_stay_runs_from_the_first_to_the_last_step_start_that_finds_it() -> None:
    queue = Queue()
    stats = queue.stats
    stats.step_start(0)
    queue.add("a", 2)
    stats.step_start(1 * S)  # first found
    stats.step_start(2 * S)
    stats.step_start(3 * S)  # last found: this step starts it
    queue.start("a")
    assert stats.wait_ns == {}  # counted once gone
    stats.step_start(4 * S)
    assert stats.wait_ns == {"batch": 2 * S}
    assert stats.queued == dict.fromkeys(BANDS, 0)
    stats.step_start(5 * S)
    assert stats.wait_ns == {"batch": 2 * S}  # once


def test_a_preempted_request_waits_from_the_step_that_preempted_it() -> None:
    queue = Queue()
    stats = queue.stats
    stats.step_start(1 * S)
    queue.add("a", 0, status=RequestStatus.PREEMPTED)  # by the step at 1 s
    stats.step_start(2 * S)
    queue.start("a")
    stats.step_start(3 * S)
    assert stats.wait_ns == {"interactive": 1 * S}
    # Preempted again later: a second stay, added to the first.
    queue.add("a", 0, status=RequestStatus.PREEMPTED)
    stats.step_start(5 * S)
    stats.step_start(6 * S)
    queue.start("a")
    stats.step_start(7 * S)
    assert stats.wait_ns == {"interactive": 1 * S + 3 * S}


def test_a_request_started_in_the_step_that_first_found_it_waited_nothing() -> None:
    queue = Queue()
    stats = queue.stats
    stats.step_start(0)
    queue.add("a", 1)
    stats.step_start(1 * S)
    queue.start("a")
    stats.step_start(2 * S)
    assert stats.wait_ns == {}


def test_a_stay_counts_in_the_band_of_its_last_step_start() -> None:
    queue = Queue()
    stats = queue.stats
    request = queue.add("a", 2)
    stats.step_start(0)
    request.band = 0  # e.g. its user moved to another band
    stats.step_start(2 * S)
    queue.start("a")
    stats.step_start(3 * S)
    assert stats.wait_ns == {"interactive": 2 * S}


def test_an_ended_request_is_settled_at_once_and_leaves_the_count() -> None:
    queue = Queue()
    stats = queue.stats
    queue.add("a", 2)
    queue.add("b", 2)
    queue.add("kv", 2, status=RequestStatus.WAITING_FOR_REMOTE_KVS)
    stats.step_start(0)
    stats.step_start(2 * S)
    assert stats.queued == {"interactive": 0, "standard": 0, "batch": 2}
    before = stats.fingerprint()
    queue.start("a")  # aborted: upstream frees it, then the hook runs
    stats.request_ended("a")
    assert stats.wait_ns == {"batch": 2 * S}
    assert stats.queued == {"interactive": 0, "standard": 0, "batch": 1}
    assert stats.fingerprint() != before
    queue.start("kv")
    stats.request_ended("kv")  # never counted as waiting: the count stays
    assert stats.queued["batch"] == 1
    assert stats.wait_ns == {"batch": 4 * S}
    stats.request_ended("a")  # once
    stats.request_ended("never-waited")
    stats.step_start(3 * S)
    assert stats.wait_ns == {"batch": 4 * S}
    assert stats.queued == {"interactive": 0, "standard": 0, "batch": 1}


def test_without_bands_nothing_is_kept_and_stays_start_over() -> None:
    queue = Queue()
    stats = queue.stats
    queue.table = BandTable(names=("only",))
    queue.add("a", 0)
    stats.step_start(0)
    assert (stats.queued, stats.wait_ns) == (None, {})
    queue.table = TABLE
    stats.step_start(1 * S)
    assert stats.queued == {"interactive": 1, "standard": 0, "batch": 0}
    queue.table = BandTable()
    stats.step_start(5 * S)  # bands gone: "a"'s stay is not counted
    assert stats.queued is None
    queue.table = TABLE
    stats.step_start(6 * S)  # back: "a" is found anew
    queue.start("a")
    stats.step_start(7 * S)
    assert stats.wait_ns == {}  # started in the step that found it again
    assert stats.fingerprint() == (tuple(dict.fromkeys(BANDS, 0).items()), ())


def test_a_band_the_policy_drops_loses_its_count() -> None:
    queue = Queue()
    stats = queue.stats
    queue.add("a", 2)
    queue.add("b", 1)
    stats.step_start(0)
    stats.step_start(1 * S)
    queue.start("b")
    stats.step_start(2 * S)
    assert stats.wait_ns == {"standard": 1 * S}
    # batch is dropped; an index beyond the table's (a stale objective
    # band) counts in the lowest band.
    queue.table = BandTable(names=("interactive", "standard"), default=1)
    stats.step_start(3 * S)
    assert stats.queued == {"interactive": 0, "standard": 1}
    queue.start("a")
    stats.step_start(4 * S)
    assert stats.wait_ns == {"standard": 1 * S + 3 * S}
    # A band renamed away and back starts from zero.
    queue.table = BandTable(names=("gold", "lead"))
    stats.step_start(5 * S)
    assert stats.wait_ns == {}
