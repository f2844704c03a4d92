"""vLLM's waiting queue kept in priority-band order (part of the coupling to
vLLM with ``upstream``, which installs it while bands order the steps).

``BandedQueue`` is one FCFS deque per band, highest first: iteration, peek and
pop go band by band, so the queue is in band order at all times, and within a
band in the order requests were added (a request put back goes to the front
of its band, as upstream's FCFS queue puts it to the front). Every operation
is O(1) but removal (O(its band)); nothing is sorted per step.

A request's band is read when it is placed: a prepended request at once (it
ran, so its user is known), an added one at ``place_arrivals``. vLLM adds a
request to the queue before our ``add_request`` knows its user, so arrivals
wait last, unplaced, until the next step's start places them.

Invariant: every request in the queue is in exactly one deque (a band's, or
the arrivals'), and ``_band_at`` holds the band of each placed one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import chain
from typing import cast

from vllm.v1.core.sched.request_queue import RequestQueue
from vllm.v1.request import Request


class BandedQueue(RequestQueue):
    """The waiting queue as one deque per band (vLLM's ``RequestQueue``)."""

    def __init__(self, band_of: Callable[[Request], int]) -> None:
        self.band_of = band_of
        #: band index -> its requests, FCFS.
        self.bands: list[deque[Request]] = []
        #: Added and not yet placed, in arrival order.
        self.arrivals: deque[Request] = deque()
        #: placed request -> the index of the deque it is in.
        self._band_at: dict[Request, int] = {}
        self._count = 0

    def _band(self, band: int) -> deque[Request]:
        bands = self.bands
        while len(bands) <= band:
            bands.append(deque())
        return bands[band]

    def _place(self, request: Request, *, front: bool) -> None:
        band = self._band_at[request] = self.band_of(request)
        if front:
            self._band(band).appendleft(request)
        else:
            self._band(band).append(request)

    def place_arrivals(self) -> None:
        """Puts each arrival at the back of its band, in arrival order."""
        arrivals = self.arrivals
        while arrivals:
            self._place(arrivals.popleft(), front=False)

    def rebucket(self) -> None:
        """Places every request again by its band now (the bands changed),
        stably: in its old order within its new band."""
        everyone = list(self)
        self.bands, self._band_at = [], {}
        self.arrivals.clear()
        for request in everyone:
            self._place(request, front=False)

    def refill(self, order: Sequence[Request]) -> None:
        """Puts the queue in ``order`` (every request of the queue, once)
        within each band: split by band at once where ``order`` is already
        in band order (fair share's is), stably sorted by band first if not."""
        band_at = self._band_at
        found = list(map(band_at.get, order))
        if None in found:  # arrivals among them: placed first
            self.place_arrivals()
            found = list(map(band_at.get, order))
        bands = cast("list[int]", found)
        if bands != sorted(bands):
            ranks = sorted(range(len(order)), key=bands.__getitem__)
            order = [order[i] for i in ranks]
            bands = [bands[i] for i in ranks]
        placed: list[deque[Request]] = []
        start = 0
        for band in range(len(self.bands)):
            end = start + bands.count(band)
            placed.append(deque(order[start:end]))
            start = end
        self.bands = placed

    def add_request(self, request: Request) -> None:
        self.arrivals.append(request)
        self._count += 1

    def pop_request(self) -> Request:
        for band in self.bands:
            if band:
                request = band.popleft()
                del self._band_at[request]
                self._count -= 1
                return request
        request = self.arrivals.popleft()  # IndexError when empty, as upstream's
        self._count -= 1
        return request

    def peek_request(self) -> Request:
        for band in self.bands:
            if band:
                return band[0]
        if not self.arrivals:
            raise IndexError("peek from an empty queue")
        return self.arrivals[0]

    def prepend_request(self, request: Request) -> None:
        self._place(request, front=True)
        self._count += 1

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        """Prepends each in turn (so they end up in reverse order, as
        upstream's)."""
        for request in requests:
            self.prepend_request(request)

    def remove_request(self, request: Request) -> None:
        band = self._band_at.pop(request, None)
        if band is None:
            self.arrivals.remove(request)
        else:
            self.bands[band].remove(request)
        self._count -= 1

    def remove_requests(self, requests: Iterable[Request]) -> None:
        """Removes those of ``requests`` in the queue (others are ignored)."""
        gone = set(requests)
        band_at = self._band_at
        touched = {band_at.pop(r) for r in gone if r in band_at}
        if self.arrivals:
            touched.add(-1)
        for band in touched:
            queue = self.arrivals if band < 0 else self.bands[band]
            kept = [r for r in queue if r not in gone]
            queue.clear()
            queue.extend(kept)
        self._count = sum(map(len, self.bands)) + len(self.arrivals)

    def __bool__(self) -> bool:
        return self._count > 0

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[Request]:
        return chain(*self.bands, self.arrivals)
