"""Weighted fair share among users with budget (pure: no vLLM, no clock).

A virtual-token counter per user (VTC, "Fairness in Serving Large Language
Models", OSDI 2024) beside the GCRA caps, which stay as they are: a user out of
budget is not *eligible*; among eligible users the one with the least weighted
service goes first (mClock's split of a limit tag and a weight tag; our GCRA is
the limit, this counter the weight).

- *Service*: ``(prompt_price * prompt tokens computed + output_price * output
  tokens) / weight``. Prompt tokens found in the prefix cache are not computed,
  so not charged, and positions recomputed after a preemption are not charged
  again (the scheduler counts each position once: ``engine_ext.scheduling``).
- *Weight*: the user's own, else its tier's, else ``DEFAULT_WEIGHT``
  (``Weights``), resolved when service is charged, so a change applies from the
  next step on.
- *Lift*: a user that becomes backlogged and eligible (a first request, or its
  budget back after a GCRA pause) gets ``max(own, min over the other backlogged
  eligible users)``: service missed while idle or paused is not owed back.
- *Rebase*: once the smallest counter of a backlogged user passes
  ``REBASE_AT``, every counter is lowered by it (counters stay bounded; only
  differences matter).
- *Clean-up*: an idle user's counter is dropped once it is at or below the
  smallest backlogged counter (the lift would give it that minimum anyway), or
  when nobody is backlogged.

The cumulative weighted service and fair-share preemptions of each user, for
the metrics, are counted in ``pacing.accounting`` by the scheduler.

Invariant: ``counter`` holds a value for every user charged or lifted since it
was last cleaned up, and only for those.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from pacing.policy.errors import PathPart, PolicyError, shown

#: A user's weight when neither it nor its tier has one.
DEFAULT_WEIGHT = 1.0
#: Weights outside ``(0, MAX_WEIGHT]`` are rejected as misconfiguration.
MAX_WEIGHT = 1_000_000.0
#: Default prices of a prompt token computed and of an output token (VTC's).
DEFAULT_PROMPT_PRICE = 1.0
DEFAULT_OUTPUT_PRICE = 2.0
#: Default hysteresis, in weighted service units: a user's request yields its
#: slot to a waiting user only when its counter exceeds the waiting user's by
#: more than this (1,024 units: 512 output tokens at the default prices).
DEFAULT_HYSTERESIS = 1024.0
#: Default output tokens a request samples after each admission before it may
#: yield its slot for fair share again (no thrashing).
DEFAULT_MIN_RUN_TOKENS = 16
#: Counters are rebased once the smallest backlogged one passes this.
REBASE_AT = 1e12


def validate_weight(
    weight: object, *, field: str | Sequence[PathPart] = "weight"
) -> float:
    """``weight`` as a float if it is a valid share weight, else ``PolicyError``
    (a ValueError) at ``field``, in the one words of this rule.

    Valid: a number (not ``bool``) in ``(0, MAX_WEIGHT]``.
    """
    if (
        isinstance(weight, bool)
        or not isinstance(weight, int | float)
        or not 0 < weight <= MAX_WEIGHT
    ):
        raise PolicyError(
            f"must be a number in (0, {MAX_WEIGHT:g}], got {shown(weight)}", field
        )
    return float(weight)


def validate_price(price: object, *, field: str) -> float:
    """``price`` as a float if it is a valid service price (a number >= 0)."""
    if isinstance(price, bool) or not isinstance(price, int | float):
        raise ValueError(f"{field} must be a number >= 0, got {price!r}")
    value = float(price)
    if not (0 <= value < math.inf):
        raise ValueError(f"{field} must be a finite number >= 0, got {price!r}")
    return value


class Weights:
    """Per-user, per-tier and per-team share weights; ``DEFAULT_WEIGHT``
    otherwise. A user's weight (its own, else its tier's) counts inside its
    team; a team's weight counts among teams (``FairShareSteps``)."""

    __slots__ = ("teams", "tiers", "users")

    def __init__(
        self,
        users: Mapping[str, float] | None = None,
        tiers: Mapping[str, float] | None = None,
        teams: Mapping[str, float] | None = None,
    ) -> None:
        self.users: dict[str, float] = {
            name: validate_weight(w, field=f"weight of user {name!r}")
            for name, w in (users or {}).items()
        }
        self.tiers: dict[str, float] = {
            name: validate_weight(w, field=f"weight of tier {name!r}")
            for name, w in (tiers or {}).items()
        }
        self.teams: dict[str, float] = {
            name: validate_weight(w, field=f"weight of team {name!r}")
            for name, w in (teams or {}).items()
        }

    def of(self, user: str, tier: str | None) -> float:
        """``user``'s weight: its own, else its tier's, else the default."""
        weight = self.users.get(user)
        if weight is not None:
            return weight
        if tier is not None:
            return self.tiers.get(tier, DEFAULT_WEIGHT)
        return DEFAULT_WEIGHT

    def set_user(self, user: str, weight: float | None) -> None:
        """Sets ``user``'s own weight (None: back to its tier's or the default)."""
        if weight is None:
            self.users.pop(user, None)
        else:
            self.users[user] = validate_weight(weight, field=f"weight of {user!r}")

    def set_tier(self, tier: str, weight: float | None) -> None:
        """Sets ``tier``'s weight (None: its members weigh the default)."""
        if weight is None:
            self.tiers.pop(tier, None)
        else:
            self.tiers[tier] = validate_weight(weight, field=f"weight of {tier!r}")

    def team(self, team: str) -> float:
        """``team``'s weight among teams."""
        return self.teams.get(team, DEFAULT_WEIGHT)

    def set_team(self, team: str, weight: float | None) -> None:
        """Sets ``team``'s weight (None: the default)."""
        if weight is None:
            self.teams.pop(team, None)
        else:
            self.teams[team] = validate_weight(weight, field=f"weight of {team!r}")

    def copy(self) -> Weights:
        return Weights(self.users, self.tiers, self.teams)


@dataclass(frozen=True)
class FairShareSettings:
    """How service is priced and when a slot changes hands; see the module."""

    prompt_price: float = DEFAULT_PROMPT_PRICE
    output_price: float = DEFAULT_OUTPUT_PRICE
    hysteresis: float = DEFAULT_HYSTERESIS
    min_run_tokens: int = DEFAULT_MIN_RUN_TOKENS

    def __post_init__(self) -> None:
        validate_price(self.prompt_price, field="prompt_price")
        validate_price(self.output_price, field="output_price")
        if self.prompt_price == 0 and self.output_price == 0:
            raise ValueError("prompt_price and output_price cannot both be 0")
        validate_price(self.hysteresis, field="hysteresis")
        if isinstance(self.min_run_tokens, bool) or not isinstance(
            self.min_run_tokens, int
        ):
            raise ValueError(
                f"min_run_tokens must be an integer, got {self.min_run_tokens!r}"
            )
        if self.min_run_tokens < 1:
            raise ValueError(f"min_run_tokens must be >= 1, got {self.min_run_tokens}")


class FairShare:
    """The per-user weighted service counters; see the module docstring.

    ``enabled`` is the live switch (read at every step start, changed like the
    mode: only under the shared limiter's lock).
    """

    __slots__ = ("backlogged", "counter", "enabled", "refusal", "settings", "weights")

    def __init__(
        self,
        settings: FairShareSettings | None = None,
        weights: Weights | None = None,
        *,
        enabled: bool = False,
    ) -> None:
        self.settings = settings or FairShareSettings()
        self.weights = weights or Weights()
        self.enabled = enabled
        #: user -> its ordering key (lifted, rebased).
        self.counter: dict[str, float] = {}
        #: The users backlogged and eligible at the last step's start (set by
        #: the scheduler; the service gap is measured among them).
        self.backlogged: frozenset[str] = frozenset()
        #: Why fair share cannot run on this engine (set by the scheduler, e.g.
        #: under PRIORITY scheduling), or None: switching it on is refused with
        #: this reason.
        self.refusal: str | None = None

    def cost(self, prompt_tokens: int, output_tokens: int, weight: float) -> float:
        """Weighted service of computing that many prompt and output tokens."""
        settings = self.settings
        return (
            settings.prompt_price * prompt_tokens
            + settings.output_price * output_tokens
        ) / weight

    def charge(self, user: str, units: float) -> None:
        """Adds ``units`` of weighted service to ``user``."""
        self.counter[user] = self.counter.get(user, 0.0) + units

    def of(self, user: str) -> float:
        """``user``'s counter (0 for a user never charged or cleaned up)."""
        return self.counter.get(user, 0.0)

    def lift(self, entering: Iterable[str], backlogged: Iterable[str]) -> None:
        """Lifts each user of ``entering`` (newly backlogged and eligible) to
        the smallest counter among ``backlogged`` users not entering, when that
        is above its own; then rebases if due."""
        entering = set(entering)
        counter = self.counter
        floor = min(
            (counter.get(u, 0.0) for u in backlogged if u not in entering),
            default=None,
        )
        if floor is None:
            return
        for user in entering:
            if counter.get(user, 0.0) < floor:
                counter[user] = floor
        if floor > REBASE_AT:
            self.rebase(floor)

    def rebase(self, amount: float) -> None:
        """Lowers every counter by ``amount`` (not below 0)."""
        self.counter = {u: max(0.0, c - amount) for u, c in self.counter.items()}

    def gap(self, backlogged: Iterable[str] | None = None) -> float:
        """The largest counter difference among ``backlogged`` users (default:
        those of the last step; 0 for fewer than two)."""
        users = self.backlogged if backlogged is None else backlogged
        values = [self.counter.get(u, 0.0) for u in users]
        if len(values) < 2:
            return 0.0
        return max(values) - min(values)

    def cleanup(self, backlogged: Iterable[str]) -> None:
        """Drops the counters of users outside ``backlogged`` that are at or
        below the smallest backlogged counter (all of them when nobody is
        backlogged): the lift would give them that minimum anyway."""
        backlogged = set(backlogged)
        counter = self.counter
        floor = min((counter.get(u, 0.0) for u in backlogged), default=math.inf)
        self.counter = {
            u: c for u, c in counter.items() if u in backlogged or c > floor
        }
