"""The scheduler spends tokens only through its budget source (``pacing.budget``):
a source that is not a GCRA cell (a balance that never refills by itself, as a
store's claimed tokens) is obeyed exactly, and a shrinking budget announced
through ``limit_changes`` is never overdrawn. Real vLLM scheduler, fake clock."""

from __future__ import annotations

from collections.abc import Mapping

from pacing.limiter import MAX_RATE
from tools.scheduler_harness import SYNC_AND_ASYNC as MODES
from tools.scheduler_harness import driven_scheduler as setup
from tools.scheduler_harness import make_request


class Balances:
    """A ``BudgetSource`` of plain per-user balances: no refill with time."""

    def __init__(self, balances: Mapping[str, int]) -> None:
        self.balances = dict(balances)
        self.limit_changes = 0
        self.ended: list[str] = []
        self.lowest = min(self.balances.values())

    def deposit(self, user: str, count: int) -> None:
        self.balances[user] += count  # budget grows: no announcement needed

    def withdraw(self, user: str, count: int) -> None:
        self.balances[user] -= count
        self.limit_changes += 1  # shrinks other than by a take: announced

    def _spend(self, user: str, count: int) -> int:
        self.balances[user] -= count
        self.lowest = min(self.lowest, self.balances[user])
        return self.balances[user]

    def take_up_to(self, user: str, most: int, now_ns: int) -> tuple[int, int]:
        taken = max(0, min(most, self.balances[user]))
        return taken, self._spend(user, taken)

    def take_each(self, counts: Mapping[str, int], now_ns: int) -> dict[str, int]:
        return {user: self._spend(user, count) for user, count in counts.items()}

    def refund(self, user: str, now_ns: int, count: int = 1) -> None:
        self.balances[user] += count

    def available(self, user: str, now_ns: int) -> int:
        return max(0, self.balances[user])

    def ready_at_ns(self, user: str, now_ns: int) -> int:
        return now_ns + 1_000_000_000  # told by other means (a claim landing)

    def end_user(self, user: str, now_ns: int) -> None:
        self.ended.append(user)


def _scheduler_with(tiny_model_dir, async_scheduling, source: Balances):
    scheduler, driver = setup(tiny_model_dir, async_scheduling, default_rate=MAX_RATE)
    with scheduler.output_rate_shared.lock:
        scheduler.output_rate_shared.use_budget(source)
    return scheduler, driver


def _sampled_over(driver, steps: int) -> int:
    return sum(len(driver.step_sampled()) for _ in range(steps))


@MODES
def test_a_non_refilling_budget_is_spent_exactly_then_streams_pause(
    tiny_model_dir, async_scheduling
):
    source = Balances({"u": 10})
    scheduler, driver = _scheduler_with(tiny_model_dir, async_scheduling, source)
    requests = [make_request("u", max_tokens=100) for _ in range(3)]
    driver.add(requests)
    assert _sampled_over(driver, 30) == 10
    # Paused, not ended: every stream still running, none finished.
    assert all(r.request_id in scheduler.requests for r in requests)
    assert not any(r.is_finished() for r in requests)
    source.deposit("u", 5)
    assert _sampled_over(driver, 30) == 5
    assert source.lowest >= 0
    # The limiter (a GCRA cell per user) was never charged for "u".
    assert scheduler.limiter.tracked_users() == 0


@MODES
def test_a_budget_shrunk_with_an_announcement_is_never_overdrawn(
    tiny_model_dir, async_scheduling
):
    source = Balances({"u": 100})
    _, driver = _scheduler_with(tiny_model_dir, async_scheduling, source)
    driver.add(make_request("u", max_tokens=200) for _ in range(2))
    first = _sampled_over(driver, 5)  # free steps: the scheduler caches headroom
    assert first == 100 - source.balances["u"] > 0
    source.withdraw("u", source.balances["u"] - 3)  # 3 left, announced
    assert _sampled_over(driver, 20) == 3
    assert source.lowest >= 0


@MODES
def test_why_a_shrink_must_be_announced(tiny_model_dir, async_scheduling):
    # The same shrink without bumping limit_changes: the cached headroom still
    # says "enough", the next free step charges after the fact and overdraws.
    source = Balances({"u": 100})
    _, driver = _scheduler_with(tiny_model_dir, async_scheduling, source)
    driver.add(make_request("u", max_tokens=200) for _ in range(2))
    _sampled_over(driver, 5)
    source.balances["u"] = 0
    _sampled_over(driver, 3)
    assert source.lowest < 0


@MODES
def test_the_source_learns_when_a_users_last_request_ends(
    tiny_model_dir, async_scheduling
):
    # With a store, that is when the user's balance goes back for other engines.
    source = Balances({"short": 100, "long": 100})
    _, driver = _scheduler_with(tiny_model_dir, async_scheduling, source)
    driver.add([make_request("short", max_tokens=3)])
    driver.add(
        [make_request("long", max_tokens=3), make_request("long", max_tokens=200)]
    )
    for _ in range(12):
        driver.step()
    # "long" still has a request running: only "short" ended, and only once.
    assert source.ended == ["short"]
