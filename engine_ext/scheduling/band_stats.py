"""The waiting queue per priority band: how many requests of each band wait,
and how long they waited, for the metrics (``pacing.bands``; the payload
carries it, ``engine_ext.payload_builder``) and for band preemption's grace
(``bands.PREEMPT_AFTER_NS``: how long a request has waited).

While the policy has more than one band (as of the last step's start):

- *Queued* (``queued``): the startable requests (waiting or preempted, not
  awaiting a KV transfer or a grammar) in the waiting queue per band name, by
  ``BandSteps.bands_of`` (a request's objective band, else its user's),
  counted when it is read: each payload build, never on the step path.
- *Wait*: a request's stay in the waiting queue runs from its arrival (a
  preempted one: from the start of the step that preempted it) to the start of
  the step that schedules it, or to its end if it ends waiting, and is counted
  then, in its band then. Each stay counts (a preempted request waits again).
  Time awaiting a KV transfer or a grammar in the queue counts too. A stay
  that began while the policy had no bands is not counted.

``wait_ns`` is cumulative per band name; a band the policy drops loses its
count (one that comes back starts from zero). Without bands nothing is kept.

Cost on the step path: O(1) per step start, arrival, preemption and end, and
O(requests started) per step, only while the policy has bands.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from engine_ext.scheduling.upstream import STARTABLE, Request, Upstream
from pacing.bands import BandTable


class BandStats:
    """Per-band waits and the waiting queue per band (the engine thread's)."""

    __slots__ = (
        "_band_of_id",
        "_bands_of",
        "_names",
        "_since",
        "_table",
        "step_ns",
        "upstream",
        "wait_ns",
    )

    def __init__(
        self,
        upstream: Upstream,
        table: Callable[[], BandTable],
        bands_of: Callable[[Sequence[Request]], list[int]],
        band_of_id: Callable[[str], int],
    ) -> None:
        self.upstream = upstream
        self._table = table
        #: Each request's band (``BandSteps.bands_of``), and by request id.
        self._bands_of = bands_of
        self._band_of_id = band_of_id
        #: band name -> ns requests of the band waited, cumulative.
        self.wait_ns: dict[str, int] = {}
        #: When the last step started, while the policy had bands then; None:
        #: no such step (nothing is counted).
        self.step_ns: int | None = None
        #: request id -> when its stay in the waiting queue began.
        self._since: dict[str, int] = {}
        #: The band names counted for (the table's at the last step start).
        self._names: tuple[str, ...] = ()

    def step_start(self, now_ns: int) -> None:
        """A step starts: stays are counted while the policy has bands."""
        table = self._table()
        if not table.active:
            if self.step_ns is not None:
                self.step_ns, self._since = None, {}
            return
        names = table.names
        if names != self._names:
            self._names = names
            self.wait_ns = {n: ns for n, ns in self.wait_ns.items() if n in names}
        self.step_ns = now_ns

    def added(self, request_id: str, now_ns: int) -> None:
        """A request arrived in the waiting queue."""
        if self.step_ns is not None:
            self._since[request_id] = now_ns

    def preempted(self, request_id: str) -> None:
        """A running request went back to the waiting queue in this step."""
        if self.step_ns is not None:
            self._since[request_id] = self.step_ns

    def started(self, request_ids: Iterable[str]) -> None:
        """The step that started at ``step_ns`` scheduled these requests from
        the waiting queue: their stays end."""
        since = self._since
        step_ns = self.step_ns
        if step_ns is None or not since:
            return
        for request_id in request_ids:
            began = since.pop(request_id, None)
            if began is not None:
                self._add(request_id, step_ns - began)

    def waited_ns(self, request_id: str) -> int | None:
        """How long ``request_id``'s stay in the waiting queue had lasted at
        this step's start; None if no stay of it is counted (not waiting, or
        it began while the policy had no bands)."""
        began = self._since.get(request_id)
        step_ns = self.step_ns
        return None if began is None or step_ns is None else step_ns - began

    def request_ended(self, request_id: str, now_ns: int) -> None:
        """A request ended; if it ended waiting, its stay ends now."""
        began = self._since.pop(request_id, None)
        if began is not None:
            self._add(request_id, now_ns - began)

    @property
    def queued(self) -> dict[str, int] | None:
        """band name -> startable requests in the waiting queue now; None
        while the policy has no bands."""
        if self.step_ns is None:
            return None
        names = self._names
        counts = dict.fromkeys(names, 0)
        startable = [
            request for request in self.upstream.waiting if request.status in STARTABLE
        ]
        for band in self._bands_of(startable):
            counts[names_at(band, names)] += 1
        return counts

    def fingerprint(self) -> tuple[object, ...]:
        """What the payload reports of the bands' queue (for the idle
        heartbeat, ``engine_ext.idle_stats``): equal while nothing changed."""
        queued = self.queued
        return (
            None if queued is None else tuple(queued.items()),
            tuple(self.wait_ns.items()),
        )

    def _add(self, request_id: str, ns: int) -> None:
        if ns <= 0:
            return
        name = names_at(self._band_of_id(request_id), self._names)
        self.wait_ns[name] = self.wait_ns.get(name, 0) + ns


def names_at(band: int, names: tuple[str, ...]) -> str:
    """The name of band index ``band`` (the lowest band for an index beyond)."""
    return names[min(band, len(names) - 1)]
