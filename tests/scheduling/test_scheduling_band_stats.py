"""Tests for ``engine_ext.scheduling.band_stats``: the waiting queue per band,
and how long requests waited, for the metrics.

What must hold: while the policy has bands (as of the last step's start), a
read of ``queued`` counts the startable requests waiting per band (every band,
zeros too); a stay runs from a request's arrival (a preempted one: the start
of the step that preempted it) to the start of the step that schedules it, or
to its end if it ends waiting, and counts once, in its band then. Without
bands nothing is kept.
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
    each request's band (``BandSteps.bands_of``)."""

    def __init__(self) -> None:
        self.waiting: list[FakeRequest] = []
        self.known: dict[str, FakeRequest] = {}
        self.table = TABLE
        self.stats = BandStats(
            SimpleNamespace(waiting=self.waiting),  # type: ignore[arg-type]
            lambda: self.table,
            lambda requests: [r.band for r in requests],
            lambda request_id: self.known[request_id].band,
        )

    def add(self, request_id: str, band: int, at: int, **kw) -> FakeRequest:
        request = self.known[request_id] = FakeRequest(request_id, band, **kw)
        self.waiting.append(request)
        self.stats.added(request_id, at)
        return request

    def start(self, *request_ids: str) -> None:
        """The step that started last schedules ``request_ids``."""
        self.waiting[:] = [r for r in self.waiting if r.request_id not in request_ids]
        self.stats.started(request_ids)


def test_queued_counts_the_startable_requests_of_every_band() -> None:
    queue = Queue()
    queue.stats.step_start(0)
    queue.add("a", 0, 0)
    queue.add("b", 0, 0, status=RequestStatus.PREEMPTED)
    queue.add("c", 2, 0)
    queue.add("kv", 2, 0, status=RequestStatus.WAITING_FOR_REMOTE_KVS)
    queue.add("fsm", 1, 0, status=RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR)
    assert queue.stats.queued == {"interactive": 2, "standard": 0, "batch": 1}
    queue.start("a", "c")
    assert queue.stats.queued == {"interactive": 1, "standard": 0, "batch": 0}
    assert queue.stats.wait_ns == {}  # started in the step they arrived before


def test_a_stay_runs_from_arrival_to_the_step_that_schedules_it() -> None:
    queue = Queue()
    stats = queue.stats
    stats.step_start(0)
    queue.add("a", 2, at=S // 2)
    stats.step_start(1 * S)
    stats.step_start(2 * S)
    stats.step_start(3 * S)
    queue.start("a")
    assert stats.wait_ns == {"batch": 3 * S - S // 2}
    stats.step_start(4 * S)
    queue.start("a")  # once
    assert stats.wait_ns == {"batch": 3 * S - S // 2}
    assert stats.queued == dict.fromkeys(BANDS, 0)


def test_a_preempted_request_waits_from_the_step_that_preempted_it() -> None:
    queue = Queue()
    stats = queue.stats
    stats.step_start(0)
    queue.add("a", 0, at=0)
    queue.start("a")
    stats.step_start(1 * S)
    queue.known["a"].status = RequestStatus.PREEMPTED
    queue.waiting.append(queue.known["a"])
    stats.preempted("a")  # by the step at 1 s
    stats.step_start(2 * S)
    stats.step_start(3 * S)
    queue.start("a")
    assert stats.wait_ns == {"interactive": 2 * S}
    # Preempted again later: a second stay, added to the first.
    stats.step_start(5 * S)
    stats.preempted("a")
    stats.step_start(6 * S)
    queue.start("a")
    assert stats.wait_ns == {"interactive": 2 * S + 1 * S}


def test_a_stay_counts_in_the_band_of_its_end() -> None:
    queue = Queue()
    stats = queue.stats
    stats.step_start(0)
    request = queue.add("a", 2, at=0)
    request.band = 0  # e.g. its user moved to another band
    stats.step_start(2 * S)
    queue.start("a")
    assert stats.wait_ns == {"interactive": 2 * S}


def test_a_request_that_ends_waiting_is_counted_to_its_end() -> None:
    queue = Queue()
    stats = queue.stats
    stats.step_start(0)
    queue.add("a", 2, at=0)
    queue.add("b", 2, at=0)
    stats.step_start(2 * S)
    assert stats.queued == {"interactive": 0, "standard": 0, "batch": 2}
    before = stats.fingerprint()
    queue.waiting.remove(queue.known["a"])  # aborted: upstream frees it
    stats.request_ended("a", 3 * S)
    assert stats.wait_ns == {"batch": 3 * S}
    assert stats.queued == {"interactive": 0, "standard": 0, "batch": 1}
    assert stats.fingerprint() != before
    stats.request_ended("a", 4 * S)  # once
    stats.request_ended("never-waited", 4 * S)
    queue.start("b")
    assert stats.wait_ns == {"batch": 3 * S + 2 * S}
    stats.request_ended("b", 9 * S)  # ended running: its stay was counted
    assert stats.wait_ns == {"batch": 5 * S}


def test_without_bands_nothing_is_kept_and_stays_start_over() -> None:
    queue = Queue()
    stats = queue.stats
    queue.table = BandTable(names=("only",))
    stats.step_start(0)
    queue.add("a", 0, at=0)  # no bands: not counted
    assert (stats.queued, stats.wait_ns) == (None, {})
    queue.table = TABLE
    stats.step_start(1 * S)
    assert stats.queued == {"interactive": 1, "standard": 0, "batch": 0}
    queue.add("b", 0, at=1 * S)
    queue.table = BandTable()
    stats.step_start(5 * S)  # bands gone: "b"'s stay is not counted
    assert stats.queued is None
    queue.table = TABLE
    stats.step_start(6 * S)
    queue.start("a", "b")
    assert stats.wait_ns == {}
    assert stats.fingerprint() == (tuple(dict.fromkeys(BANDS, 0).items()), ())


def test_a_band_the_policy_drops_loses_its_count() -> None:
    queue = Queue()
    stats = queue.stats
    stats.step_start(0)
    queue.add("a", 2, at=0)
    queue.add("b", 1, at=0)
    stats.step_start(1 * S)
    queue.start("b")
    assert stats.wait_ns == {"standard": 1 * S}
    # batch is dropped; an index beyond the table's (a stale objective
    # band) counts in the lowest band.
    queue.table = BandTable(names=("interactive", "standard"), default=1)
    stats.step_start(3 * S)
    assert stats.queued == {"interactive": 0, "standard": 1}
    queue.start("a")
    assert stats.wait_ns == {"standard": 1 * S + 3 * S}
    # A band renamed away and back starts from zero.
    queue.table = BandTable(names=("gold", "lead"))
    stats.step_start(5 * S)
    assert stats.wait_ns == {}
