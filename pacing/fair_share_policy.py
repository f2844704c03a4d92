"""The fair-share part of a limits table: the switch and the weights (pure).

They are the operator's policy, like the limits: the limits file holds them and
a global store carries them to every engine with the table. The weighted-service
counters stay each engine's own (``pacing.fair_share``): fair share is per
engine, caps are global.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from pacing.fair_share import FairShare


@dataclass(frozen=True)
class SharePolicy:
    """Whether fair share is on, and the users', tiers' and teams' own weights."""

    enabled: bool = False
    users: Mapping[str, float] = field(default_factory=dict)
    tiers: Mapping[str, float] = field(default_factory=dict)
    teams: Mapping[str, float] = field(default_factory=dict)


def policy_of(ledger: FairShare) -> SharePolicy:
    """A copy of ``ledger``'s switch and weights."""
    weights = ledger.weights
    return SharePolicy(
        ledger.enabled, dict(weights.users), dict(weights.tiers), dict(weights.teams)
    )


def apply_policy(ledger: FairShare, policy: SharePolicy) -> bool:
    """Makes ``policy`` the ledger's (weights already validated), switching fair
    share on only where the engine can run it (``ledger.refusal`` is None);
    returns whether anything changed. Run under the shared limiter's lock."""
    weights = ledger.weights
    changed = False
    if policy.users != weights.users:
        weights.users = dict(policy.users)
        changed = True
    if policy.tiers != weights.tiers:
        weights.tiers = dict(policy.tiers)
        changed = True
    if policy.teams != weights.teams:
        weights.teams = dict(policy.teams)
        changed = True
    enabled = policy.enabled and ledger.refusal is None
    if enabled != ledger.enabled:
        ledger.enabled = enabled
        changed = True
    return changed
