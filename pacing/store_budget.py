"""The scheduler's budget with a global store: claimed balances while the store
answers, a designed fallback while it does not.

``StoreBudget`` is the ``BudgetSource`` an engine spends from when
``--output-rate-store`` is set. While the store answers it is exactly the
claimed balances (``pacing.claims``). Once the store has not answered for
``DEGRADED_AFTER_NS`` (``ClaimedBalances.store_down_since_ns``), an engine
first spends what it holds, then paces each user locally at ``R / N``
(``fallback_rate``: its share of the global limit, ``N`` the live engines the
store reported, or the stated fleet size until this engine has heard their
whole count: ``ClaimedBalances.share_divisor``), so the fleet together stays
within ``R``. An engine with neither has no share to pace by: it is fail
closed instead (limited users wait for the store). After ``failure_after_ns``
of outage the failure mode decides (``FailureMode``): keep that local share
(the default), fail open (no limit) or fail closed (every limited user
paused).

Each state is one of ``Health`` (``pacing.budget``); every change of state is
announced through ``limit_changes`` (a budget may shrink: leaving fail-open,
entering fail-closed, losing the local share when the store returns), so the
scheduler's cached lower bounds never outlive the state they were read in.
``store_view`` shows a user's standing for the control plane.

Tokens spent from a local share are not charged to the store's cell, which
decays meanwhile: over a window that holds an outage's end, each engine may
add what its share granted in that window to the global bound. The clock is
injected.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from pacing.budget import Health, StoreView
from pacing.claims import ClaimedBalances, fallback_rate
from pacing.limiter import UNLIMITED, OutputRateLimiter
from pacing.settings.store import FailureMode

#: How long a fail-closed engine waits before looking again on its own (a
#: claim landing wakes it sooner).
CLOSED_RECHECK_NS = 1_000_000_000
#: How long the store must have been unreachable before the local share
#: stands in: a few timed-out round trips on a loaded host are not an outage
#: (the engine spends what it holds meanwhile), and each switch to the share
#: hands out tokens the store's cell never sees.
DEGRADED_AFTER_NS = 500_000_000


class StoreBudget:
    """``claimed`` while the store answers, the fallback of the module
    docstring while it does not. ``rates`` is the engine's limiter (where each
    user's global limit comes from); ``clock`` gives monotonic nanoseconds."""

    def __init__(
        self,
        claimed: ClaimedBalances,
        rates: OutputRateLimiter,
        clock: Callable[[], int],
        *,
        failure_mode: FailureMode = FailureMode.KEEP_LOCAL_SHARE,
        failure_after_ns: int,
    ) -> None:
        self.claimed = claimed
        self._rates = rates
        self._clock = clock
        self._failure_mode = failure_mode
        self._failure_after_ns = failure_after_ns
        #: Local GCRA cells at each user's share (rates set as users need
        #: them), kept across outages.
        self._share = OutputRateLimiter(1, {}, burst_ns=rates.burst_ns)
        self._share_rates: dict[str, int] = {}
        self._health = Health.GLOBAL
        self._health_changes = 0

    def health(self, now_ns: int) -> Health:
        """The state at ``now_ns`` (a change is counted in ``limit_changes``)."""
        down_since = self.claimed.store_down_since_ns
        if down_since is None or now_ns - down_since < DEGRADED_AFTER_NS:
            health = Health.GLOBAL
        elif now_ns - down_since < self._failure_after_ns:
            health = Health.LOCAL_SHARE
        else:
            health = {
                FailureMode.KEEP_LOCAL_SHARE: Health.LOCAL_SHARE,
                FailureMode.FAIL_OPEN: Health.FAIL_OPEN,
                FailureMode.FAIL_CLOSED: Health.FAIL_CLOSED,
            }[self._failure_mode]
        if health is Health.LOCAL_SHARE and self.claimed.share_divisor is None:
            health = Health.FAIL_CLOSED  # no count to share by: nothing is safe
        if health is not self._health:
            self._health = health
            self._health_changes += 1
        return health

    # -- the budget source -------------------------------------------------------

    @property
    def limit_changes(self) -> int:
        """The claimed balances' changes plus every change of ``health``."""
        self.health(self._clock())
        return self.claimed.limit_changes + self._health_changes

    def take_up_to(self, user: str, most: int, now_ns: int) -> tuple[int, int]:
        health = self.health(now_ns)
        if health is Health.GLOBAL:
            return self.claimed.take_up_to(user, most, now_ns)
        if self._rates.rate_of(user) == 0 or health is Health.FAIL_OPEN:
            return most, UNLIMITED - most
        if health is Health.FAIL_CLOSED:
            return 0, 0
        held, held_left = self.claimed.take_up_to(user, most, now_ns)
        shared, share_left = self._share_of(user, now_ns).take_up_to(
            user, most - held, now_ns
        )
        return held + shared, held_left + share_left

    def take_each(self, counts: Mapping[str, int], now_ns: int) -> dict[str, int]:
        if self.health(now_ns) is Health.GLOBAL:
            return self.claimed.take_each(counts, now_ns)
        # Charges already decided: spend what is held first, then the share.
        remaining: dict[str, int] = {}
        for user, count in counts.items():
            taken, left = self.take_up_to(user, count, now_ns)
            if taken < count:  # dispatched all the same: the share goes in debt
                self._share_of(user, now_ns).take_each({user: count - taken}, now_ns)
            remaining[user] = left
        return remaining

    def refund(self, user: str, now_ns: int, count: int = 1) -> None:
        if self.health(now_ns) is Health.GLOBAL:
            self.claimed.refund(user, now_ns, count)
        else:  # a share never gains budget it did not earn, so never too much
            self._share_of(user, now_ns).refund(user, now_ns, count)

    def available(self, user: str, now_ns: int) -> int:
        health = self.health(now_ns)
        if health is Health.GLOBAL:
            return self.claimed.available(user, now_ns)
        if self._rates.rate_of(user) == 0 or health is Health.FAIL_OPEN:
            return UNLIMITED
        if health is Health.FAIL_CLOSED:
            return 0
        return self.claimed.available(user, now_ns) + self._share_of(
            user, now_ns
        ).available(user, now_ns)

    def ready_at_ns(self, user: str, now_ns: int) -> int:
        health = self.health(now_ns)
        if health is Health.GLOBAL:
            return self.claimed.ready_at_ns(user, now_ns)
        if health is Health.FAIL_CLOSED:
            return now_ns + CLOSED_RECHECK_NS
        if self._rates.rate_of(user) == 0 or health is Health.FAIL_OPEN:
            return now_ns
        return min(
            self.claimed.ready_at_ns(user, now_ns),
            self._share_of(user, now_ns).ready_at_ns(user, now_ns),
        )

    def end_user(self, user: str, now_ns: int) -> None:
        self.claimed.end_user(user, now_ns)

    # -- the control plane's view (``pacing.budget.StoreViews``) ---------------

    def store_view(self, user: str, now_ns: int) -> StoreView:
        """What this engine holds for ``user``, the user's global TAT lead as
        last read (``ClaimedBalances.cell_reading``) and this engine's state."""
        reading = self.claimed.cell_reading(user, now_ns)
        return StoreView(
            held_tokens=self.claimed.held(user, now_ns),
            global_tat_lead_ns=0 if reading is None else reading.tat_lead_ns,
            read_age_ns=None if reading is None else reading.age_ns,
            health=self.health(now_ns),
        )

    def _share_of(self, user: str, now_ns: int) -> OutputRateLimiter:
        """The local limiter, with ``user``'s rate set to its share now."""
        divisor = self.claimed.share_divisor
        assert divisor is not None  # without one, health() is never LOCAL_SHARE
        share = fallback_rate(self._rates.rate_of(user), divisor)
        if self._share_rates.get(user) != share:
            self._share_rates[user] = share
            self._share.set_rate(user, share, now_ns)
        return self._share
