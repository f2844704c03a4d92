"""Priority bands in the step: a waiting request of a higher band starts before
any of a lower band (``pacing.bands`` holds the bands and each user's).

While the policy has more than one band (and the mode is not ``off``):

- *Order*: the waiting queue is banded (``upstream_queue.BandedQueue``, set
  up at a step's start): it is in band order, highest first, at all times, and
  within a band in upstream's order, or fair share's (with fair share on,
  ``fair_share`` orders by band and then by its counters, and moves slots for
  fair share only between requests of one band). Arrivals take their band at
  the next step's start; a change of table places every request again.
- *Preemption*, at every step's start: when no slot is free for a waiting
  request of band ``k`` whose user may start (has budget) and that has waited
  ``PREEMPT_AFTER_NS`` (a slot that frees sooner spares a recomputation), a
  running request of a lower band yields its slot (vLLM's preemption,
  recomputed on resume; prefix caching makes that cheap): the lowest band
  first, in it the user holding the most slots, its request with the fewest
  computed tokens. At most one victim per
  waiting request, never more than the active cap lets start, after parked
  requests have yielded (``slots``). So a request whose band has a victim
  below it starts at the latest in the first step that starts
  ``PREEMPT_AFTER_NS`` after its arrival. A request that yielded for a band
  samples ``MIN_RUN_TOKENS`` after it resumes before it may yield again,
  so every admission earns tokens: each preemption lets one higher-band
  request start, and a lower-band request is preempted at most once per
  ``MIN_RUN_TOKENS`` of its output.

Only FCFS scheduling: under PRIORITY, vLLM keeps the waiting queue as a heap by
request priority, so bands refuse to start (``PRIORITY_REFUSAL``) and a table
with bands applied later orders nothing. vLLM takes a per-request priority
only under PRIORITY, so no request priority is mapped to a band.

Invariant: no request yields to one of its own or a lower band.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from engine_ext.scheduling.upstream import STARTABLE, Upstream
from engine_ext.scheduling.users import UserBook
from pacing.bands import BandTable
from pacing.identity import ANONYMOUS_USER

if TYPE_CHECKING:
    from engine_ext.scheduling.upstream import Request

#: Output tokens a request samples after it resumes before it may yield its
#: slot to a higher band again.
MIN_RUN_TOKENS = 16
#: How long a higher band's request waits for a slot to free by itself before
#: a lower band's running request yields one (scheduler clock, from arrival:
#: ``BandStats.waited_ns``). Most waits on a busy engine end sooner, as
#: requests finish; each preemption avoided is a prefill not recomputed.
PREEMPT_AFTER_NS = 50_000_000
#: Users whose band is cached at most (then the cache starts over).
_MAX_CACHED_USERS = 65_536
#: Why bands do not run under PRIORITY scheduling.
PRIORITY_REFUSAL = (
    "bands order the waiting queue by band; --scheduling-policy priority keeps "
    "it as a heap by request priority, which reorders whatever is imposed on it: "
    "run bands with the default fcfs policy (they replace request priorities)"
)


class BandSteps:
    """Bands around one scheduler's steps (the shared lock is held)."""

    __slots__ = (
        "_by_request",
        "_by_user",
        "_cached_table",
        "_queued_table",
        "_request_of",
        "book",
        "floor",
        "request_band",
        "table",
        "team_of",
        "tier_of",
        "upstream",
        "waited_ns",
    )

    def __init__(
        self,
        upstream: Upstream,
        book: UserBook,
        table: Callable[[], BandTable],
        tier_of: Callable[[str], str | None],
        team_of: Callable[[str], str | None],
    ) -> None:
        if upstream.priority_policy and table().active:
            raise ValueError(PRIORITY_REFUSAL)
        self.upstream = upstream
        self.book = book
        self.table = table
        self.tier_of = tier_of
        self.team_of = team_of
        #: request id -> the band its request was put in (the gateway's
        #: objective), instead of its user's.
        self.request_band: dict[str, int] = {}
        #: request id -> output tokens it must reach before it may yield again.
        self.floor: dict[str, int] = {}
        #: The table the caches below were filled under (a change of
        #: membership or band comes with a new table, and empties them).
        self._cached_table: BandTable | None = None
        #: A live request looked up -> its band. Keyed by the request itself:
        #: its hash reads no attribute, so the step's walks touch one line of
        #: each request's memory, not three (its id and that string too).
        self._by_request: dict[Request, int] = {}
        #: request id -> the request, for those in ``_by_request``.
        self._request_of: dict[str, Request] = {}
        #: The table the banded waiting queue was placed under.
        self._queued_table: BandTable | None = None
        #: user -> its band.
        self._by_user: dict[str, int] = {}
        #: How long a waiting request has waited at this step's start (None:
        #: not known, taken as long enough): ``BandStats.waited_ns``.
        self.waited_ns: Callable[[str], int | None] = _unknown_wait

    def active(self) -> bool:
        """Whether bands order this step: more than one band, FCFS scheduling
        (a table with bands applied later under PRIORITY is not: see
        ``PRIORITY_REFUSAL``)."""
        return self.table().active and not self.upstream.priority_policy

    def band_of(self, request: Request) -> int:
        """``request``'s band index (0: the highest)."""
        self._current_table()
        band = self._by_request.get(request)
        return self._learned(request) if band is None else band

    def bands_of(self, requests: Sequence[Request]) -> list[int]:
        """The band index of each of ``requests``, in order (one table check,
        then a dict read per request: the step's walks call this)."""
        self._current_table()
        bands = list(map(self._by_request.get, requests))
        if None in bands:  # arrived under another table: learned here, once
            learned, i = self._learned, -1
            while (i := _index_of_none(bands, i + 1)) >= 0:
                bands[i] = learned(requests[i])
        return bands  # type: ignore[return-value]

    def band_of_id(self, request_id: str) -> int:
        """The band of the request ``request_id`` (one looked up before: as
        then; else its objective's or its user's now)."""
        self._current_table()
        request = self._request_of.get(request_id)
        if request is not None and (band := self._by_request.get(request)) is not None:
            return band
        return self._band_under_table(request_id)

    def _current_table(self) -> None:
        """Empties the caches if the table in force changed since they filled."""
        table = self.table()
        if table is not self._cached_table:
            self._cached_table = table
            self._by_request = {}
            self._request_of = {}
            self._by_user = {}

    def _learned(self, request: Request) -> int:
        """``request``'s band under the cached table, remembered until the
        request ends."""
        request_id = request.request_id
        band = self._by_request[request] = self._band_under_table(request_id)
        self._request_of[request_id] = request
        return band

    def _band_under_table(self, request_id: str) -> int:
        """The gateway's objective band of ``request_id`` (unless a reload left
        fewer bands than it names), else its user's (cached per user)."""
        table = self._cached_table
        assert table is not None
        band = self.request_band.get(request_id)
        if band is None or band >= len(table.names):
            user = self.book.user_of.get(request_id, ANONYMOUS_USER)
            by_user = self._by_user
            band = by_user.get(user)
            if band is None:
                if len(by_user) >= _MAX_CACHED_USERS:
                    by_user.clear()
                band = by_user[user] = table.index_of(
                    user, self.tier_of(user), self.team_of(user)
                )
        return band

    def request_ended(self, request_id: str) -> None:
        self.request_band.pop(request_id, None)
        self.floor.pop(request_id, None)
        request = self._request_of.pop(request_id, None)
        if request is not None:
            self._by_request.pop(request, None)

    def preempted(self, request: Request) -> None:
        """Any preemption: the request must sample ``MIN_RUN_TOKENS`` after it
        resumes before it may yield for a band."""
        self.floor[request.request_id] = request.num_output_tokens + MIN_RUN_TOKENS

    def step_start(self, on: bool) -> None:
        """A step starts: the waiting queue is banded while bands order the
        steps (``on``), FCFS otherwise; a banded one is placed again if the
        table changed, and takes its arrivals into their bands."""
        upstream = self.upstream
        queue = upstream.banded_waiting
        if not on:
            if queue is not None:
                upstream.unband_waiting()
            return
        table = self.table()
        if queue is None:
            self._queued_table = table
            upstream.band_waiting(self.band_of)
        elif table is not self._queued_table:
            self._queued_table = table
            queue.rebucket()
        else:
            queue.place_arrivals()

    def before_step(self, can_start: Callable[[str], bool]) -> None:
        """Preempts lower bands' running requests for waiting higher-band ones
        (the banded queue keeps the order). The cheap
        checks come first (most steps of a saturated engine have nothing to
        move), and only the waiting requests above the lowest running band
        are looked at: the free slots go to the highest bands first, so those
        below cannot take a victim."""
        upstream = self.upstream
        queue = upstream.banded_waiting
        if not queue:
            return
        free = max(0, upstream.slots - upstream.held_slots())
        if len(queue) <= free:
            return  # every waiting request finds a slot
        counts = list(map(len, queue.bands))
        best = next((band for band, count in enumerate(counts) if count), None)
        if best is None:
            return  # arrivals only: placed at the next step's start
        running = upstream.running
        running_bands = self.bands_of(running)
        lowest_running = max(running_bands, default=-1)
        if lowest_running <= best:
            return  # nothing runs below the best waiting band
        if sum(counts[:lowest_running]) <= free:
            return  # the free slots take every request that could preempt
        # The waiting requests above the lowest running band, in band order:
        # the first ``free`` receivers (those that may start) take the free
        # slots, each one after them may free a slot (and a place under the
        # active cap) of a lower band once it waited long enough. A receiver's
        # place is at most its place here, so one after the first ``free``
        # here must have waited.
        bands = queue.bands
        above = [
            (band, request)
            for band in range(best, lowest_running)
            for request in bands[band]
        ]
        waited_ns = self.waited_ns
        if not any(
            _waited_enough(waited_ns(request.request_id)) for _, request in above[free:]
        ):
            return
        user_of = self.book.user_of
        receivers: list[tuple[int, str]] = []
        for band, request in above:
            if request.status in STARTABLE and can_start(
                user_of.get(request.request_id, ANONYMOUS_USER)
            ):
                receivers.append((band, request.request_id))
        wanting = [
            band
            for band, request_id in receivers[free:]
            if _waited_enough(waited_ns(request_id))
        ]
        if not wanting:
            return
        held_by: dict[tuple[int, str], int] = {}
        candidates: list[tuple[int, str, Request]] = []
        floor = self.floor
        for request, band in zip(running, running_bands, strict=True):
            if band <= best:
                continue  # never a victim
            user = user_of.get(request.request_id, ANONYMOUS_USER)
            held_by[(band, user)] = held_by.get((band, user), 0) + 1
            if request.num_output_tokens >= floor.get(
                request.request_id, 0
            ) and upstream.blocks_can_be_freed(request):
                candidates.append((band, user, request))
        for band in wanting:
            victim = _best_victim(candidates, held_by, band)
            if victim is None:
                break  # none below this band, nor below the next ones
            victim_band, victim_user, victim_request = victim
            candidates.remove(victim)
            held_by[(victim_band, victim_user)] -= 1
            upstream.preempt(victim_request)


def _unknown_wait(request_id: str) -> None:
    return None


def _waited_enough(waited_ns: int | None) -> bool:
    """Whether a request that waited ``waited_ns`` (None: not known) may take
    a lower band's slot."""
    return waited_ns is None or waited_ns >= PREEMPT_AFTER_NS


def _index_of_none(values: list[int | None], start: int) -> int:
    """The index of the first None in ``values`` from ``start`` (-1: none)."""
    try:
        return values.index(None, start)
    except ValueError:
        return -1


def _best_victim(
    candidates: list[tuple[int, str, Request]],
    held_by: dict[tuple[int, str], int],
    below: int,
) -> tuple[int, str, Request] | None:
    """The candidate of the lowest band under ``below``, its user holding the
    most slots of that band, its request with the fewest computed tokens."""
    best = None
    best_key = None
    for candidate in candidates:
        band, user, request = candidate
        if band <= below:
            continue
        key = (band, held_by[(band, user)], -request.num_computed_tokens)
        if best_key is None or key > best_key:
            best, best_key = candidate, key
    return best
