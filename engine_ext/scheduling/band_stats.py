"""The waiting queue per priority band, for the metrics: what each step's start
finds waiting, and how long requests waited (``pacing.bands``; the payload
carries it, ``engine_ext.payload_builder``).

While the policy has more than one band, every step's start (``step_start``,
before bands or fair share reorder or preempt anything) walks the waiting
queue once:

- *Queued* (``queued``): the startable requests (waiting or preempted, not
  awaiting a KV transfer or a grammar) per band name, by ``BandSteps.band_of``
  (a request's objective band, else its user's). A request that ends before
  the next step starts leaves the count at once (``request_ended``): an engine
  that goes idle does not keep reporting it.
- *Wait*: a request's stay in the waiting queue runs from the step start that
  first finds it there (a preempted one: from the step before, which preempted
  it) to the last step start that finds it there (the step that starts it), and
  is counted, in its band then, once it is gone: at the next step's start, or
  when it ends (``request_ended``). Each stay counts (a preempted request waits
  again). Time awaiting a KV transfer or a grammar in the queue counts too.
  Requests are added and ended between steps and the next step starts right
  after, so a stay is measured to within one step's gap.

``wait_ns`` is cumulative per band name; a band the policy drops loses its
count (one that comes back starts from zero). Without bands nothing is kept.

Cost: O(waiting requests) per step start, only while the policy has bands.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from engine_ext.scheduling.upstream import STARTABLE, Upstream
from pacing.bands import BandTable

if TYPE_CHECKING:
    from engine_ext.scheduling.upstream import Request

#: ``STARTABLE`` is (waiting, preempted).
_PREEMPTED = STARTABLE[1]


class BandStats:
    """The waiting queue per band at each step's start (the shared lock is held)."""

    __slots__ = (
        "_band_of",
        "_names",
        "_seen",
        "_table",
        "last_step_ns",
        "queued",
        "upstream",
        "wait_ns",
    )

    def __init__(
        self,
        upstream: Upstream,
        table: Callable[[], BandTable],
        band_of: Callable[[Request], int],
    ) -> None:
        self.upstream = upstream
        self._table = table
        self._band_of = band_of
        #: band name -> startable requests in the waiting queue at the last
        #: step start, less those ended since; None: no step start has
        #: counted (or the policy has no bands).
        self.queued: dict[str, int] | None = None
        #: band name -> ns requests of the band waited, cumulative.
        self.wait_ns: dict[str, int] = {}
        #: When the last step started that counted; None: none yet.
        self.last_step_ns: int | None = None
        #: request id -> (when its stay in the queue began, its band, whether
        #: it was startable), for the requests the last step start found.
        self._seen: dict[str, tuple[int, str, bool]] = {}
        #: The band names counted for (the table's at the last step start).
        self._names: tuple[str, ...] = ()

    def step_start(self, now_ns: int) -> None:
        """Counts the waiting queue at a step's start; settles the stays of the
        requests that left it since the previous one."""
        table = self._table()
        if not table.active:
            if self.last_step_ns is not None:
                self.queued, self.last_step_ns = None, None
                self._seen = {}
            return
        names = table.names
        if names != self._names:
            self._names = names
            self.wait_ns = {n: ns for n, ns in self.wait_ns.items() if n in names}
        previous_ns = self.last_step_ns
        before = self._seen
        seen: dict[str, tuple[int, str, bool]] = {}
        counts = dict.fromkeys(names, 0)
        last = len(names) - 1
        band_of = self._band_of
        for request in self.upstream.waiting:
            status = request.status
            startable = status in STARTABLE
            name = names[min(band_of(request), last)]
            if startable:
                counts[name] += 1
            stay = before.get(request.request_id)
            if stay is not None:
                since = stay[0]
            elif status is _PREEMPTED and previous_ns is not None:
                since = previous_ns  # preempted in the previous step
            else:
                since = now_ns
            seen[request.request_id] = (since, name, startable)
        if previous_ns is not None:
            for request_id, (since, name, _) in before.items():
                if request_id not in seen:  # started by the previous step
                    self._add(name, previous_ns - since)
        self._seen = seen
        self.queued = counts
        self.last_step_ns = now_ns

    def request_ended(self, request_id: str) -> None:
        """Settles an ended request's stay, if the last step start found it
        waiting (it waited until then, or started in that step), and takes it
        out of the waiting count."""
        stay = self._seen.pop(request_id, None)
        if stay is None or self.last_step_ns is None:
            return
        since, name, startable = stay
        self._add(name, self.last_step_ns - since)
        queued = self.queued
        if startable and queued is not None and queued.get(name, 0) > 0:
            queued[name] -= 1

    def fingerprint(self) -> tuple[object, ...]:
        """What the payload reports of the bands' queue (for the idle
        heartbeat, ``engine_ext.idle_stats``): equal while nothing changed."""
        queued = self.queued
        return (
            None if queued is None else tuple(queued.items()),
            tuple(self.wait_ns.items()),
        )

    def _add(self, name: str, ns: int) -> None:
        if ns > 0 and name in self._names:  # not a band dropped since
            self.wait_ns[name] = self.wait_ns.get(name, 0) + ns
