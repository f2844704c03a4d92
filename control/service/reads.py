"""Reads of the singletons: the default, the pacing mode with the fair-share
switch, the whole table (the holders' reads are in ``holders``).

Invariant: each read takes what it returns from the limiter under one hold of
``shared.lock``, so it never shows half of a change; a list copies the table
there and sorts it after releasing the lock.
"""

from __future__ import annotations

from control import names
from control.resources import LimitsTable, PacingMode, pacing_mode, table_of
from control.service.commits import TableCommits
from pacing.policy.model import Limits


def get_default(commits: TableCommits, name: str) -> Limits:
    """The default's limits (no rate while pacing is off)."""
    names.check_singleton(name, names.DEFAULT_LIMIT, field="name")
    with commits.shared.lock:
        return commits.shared.policy.default


def get_pacing_mode(commits: TableCommits, name: str) -> PacingMode:
    """The pacing mode and the fair-share switch, with their etag."""
    names.check_singleton(name, names.PACING_MODE, field="name")
    with commits.shared.lock:
        mode = commits.shared.mode
        fair_share = commits.shared.fair_share.enabled
    return pacing_mode(commits.etags, mode, fair_share)


def get_limits_table(commits: TableCommits, name: str) -> LimitsTable:
    """The default, every entry and every tier, with the current etag."""
    names.check_singleton(name, names.LIMITS_TABLE, field="name")
    with commits.shared.lock:
        policy = commits.current_locked()
        etag = commits.etag()
    return table_of(commits.etags, policy, etag)
