"""``Accounting``: per-user counters that idle users leave, totals that stay."""

from __future__ import annotations

from pacing.accounting import Accounting


def test_forget_keeps_the_totals_and_the_kept_users() -> None:
    accounting = Accounting()
    accounting.record("alice", "charged", 5)
    accounting.record_charged({"bob": 3})
    accounting.forget({"bob"})
    assert set(accounting.by_user()) == {"bob"}
    assert accounting.total.charged == 8
    assert accounting.of("alice").charged == 0  # forgotten: zeros


def test_without_keep_forgotten_nothing_forgotten_is_kept() -> None:
    accounting = Accounting()
    accounting.record("alice", "charged", 5)
    accounting.forget(set())
    assert accounting.collect_forgotten() == []


def test_collect_forgotten_returns_each_forgotten_entry_once_in_order() -> None:
    accounting = Accounting(keep_forgotten=True)
    accounting.record("alice", "charged", 5)
    accounting.record("bob", "charged", 1)
    first_alice = accounting.by_user()["alice"]
    accounting.forget({"bob"})
    accounting.record("alice", "charged", 2)  # back: a new entry
    accounting.forget(set())
    collected = accounting.collect_forgotten()
    assert [(user, c.charged) for user, c in collected] == [
        ("alice", 5),
        ("bob", 1),
        ("alice", 2),
    ]
    assert collected[0][1] is first_alice  # the object the reader saw
    assert accounting.collect_forgotten() == []
