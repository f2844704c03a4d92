"""Prompt budgets: the uncached prompt tokens the engine computes for each user,
paced by GCRA beside its output budget (pure: no vLLM, the clock passed in).

Vocabulary:

- *prompt rate*: a holder's ``prompt_tokens_per_second`` (``pacing.policy``):
  the prompt tokens the engine may *compute* for a user per second, resolved
  as the output rate is (``pacing.limits``: the user's own, its tier's, the
  default), the same exemptions applying (an exempt user or tier is unlimited
  for both). A team's prompt rate is shared by its members (``pacing.teams``,
  cells of its own), whether or not they have one of their own. Unset: not
  paced (no default prompt rate limits nobody the table does not name).
- *burst* ``PROMPT_BURST_NS`` (1 s): a user with a full bucket may have
  ``rate`` prompt tokens computed at once, so one prompt no longer than its
  rate starts without waiting. GCRA's bound holds as for output: any window of
  ``W`` seconds holds at most ``(W + 1 s) * rate + 1`` charged prompt tokens.
- What a token costs, when, and what is held is the scheduler's concern
  (``engine_ext.scheduling.prompt_gate``); this module holds the tables and
  the cells, and is the step's ``BudgetSource`` for prompt tokens.

With a global store the cells are claimed like the output ones (``store``):
``use_budget`` puts the claimed balances in place of the local cells.

Not thread-safe; the owner serialises access (the shared limiter's lock).
"""

from __future__ import annotations

from pacing.budget import BudgetSource
from pacing.limiter import MAX_RATE, NO_DEFAULT, NS_PER_S, OutputRateLimiter
from pacing.policy.model import Policy
from pacing.teams import TeamBudget, Teams

#: The policy attribute that holds a prompt rate.
PROMPT_RATE = "prompt_tokens_per_second"
#: How far ahead of now a user's prompt TAT may run: its bucket, in time.
PROMPT_BURST_NS = NS_PER_S


def sets_prompt_rates(policy: Policy) -> bool:
    """Whether any holder of ``policy`` has a prompt rate."""
    if policy.default.prompt_tokens_per_second is not None:
        return True
    if any(
        limits.prompt_tokens_per_second is not None
        for groups in policy.groups.values()
        for limits in groups.values()
    ):
        return True
    return any(
        entry.limits.prompt_tokens_per_second is not None
        for entry in policy.users.values()
    )


class PromptBudgets:
    """The prompt rates of the policy in force, one GCRA cell per limited user
    and per team with a prompt rate."""

    __slots__ = ("_base", "_team_budget", "active", "limiter", "teams")

    def __init__(self, policy: Policy, burst_ns: int = PROMPT_BURST_NS) -> None:
        self.limiter = OutputRateLimiter(NO_DEFAULT, {}, burst_ns, table_only=True)
        self.teams = Teams(burst_ns=burst_ns)
        self._base: BudgetSource | None = None
        self._team_budget: TeamBudget | None = None
        #: Whether any holder has a prompt rate: while not, no step pays anything.
        self.active = False
        self.apply(policy, 0)

    def apply(self, policy: Policy, now_ns: int) -> None:
        """Makes ``policy``'s prompt rates the tables, each user's and team's
        debt kept (``OutputRateLimiter.set_rate``)."""
        default = policy.default.prompt_tokens_per_second
        if (default or NO_DEFAULT) != self.limiter.default_rate:
            self.limiter.set_default_rate(default or NO_DEFAULT, now_ns)
        self.limiter.replace_limits(policy.limit_table(PROMPT_RATE), now_ns)
        self.teams.replace(policy.team_table(PROMPT_RATE), now_ns)
        self.active = sets_prompt_rates(policy)

    def limits(self, user: str) -> bool:
        """Whether ``user``'s computed prompt tokens are paced (by its own
        prompt rate or its team's)."""
        if self.limiter.rate_of(user):
            return True
        return self.teams.team_of(user) is not None and not self._exempt(user)

    def rate_of(self, user: str) -> int:
        """``user``'s own prompt rate (its tier's or the default; 0: none)."""
        return self.limiter.rate_of(user)

    def use_budget(self, budget: BudgetSource | None) -> None:
        """Makes ``budget`` (claimed balances over ``limiter``) what users'
        prompt tokens are spent from; ``None``: the local cells again."""
        self._base = budget

    @property
    def budget(self) -> BudgetSource:
        """What the step spends prompt tokens from: the cells (or the store's
        claimed balances), wrapped in the teams' budget while a team has a
        prompt rate."""
        base = self.limiter if self._base is None else self._base
        if not self.teams.table:
            return base
        team_budget = self._team_budget
        if team_budget is None or team_budget.base is not base:
            team_budget = self._team_budget = TeamBudget(
                base, self.teams, self._charged_rate
            )
        return team_budget

    def ready_for_ns(self, user: str, tokens: int, now_ns: int) -> int:
        """About when ``user`` may take ``tokens`` prompt tokens at once (for
        the engine's idle wait: waking early only costs a re-plan)."""
        ready = self.budget.ready_at_ns(user, now_ns)
        rate = self.limiter.rate_of(user)
        team = self.teams.team_of(user)
        if team is not None:
            team_rate = self.teams.table.rate_of(team) or 0
            rate = min(rate, team_rate) if rate else team_rate
        if tokens <= 1 or not rate:
            return ready
        return ready + -(-(tokens - 1) * NS_PER_S // rate)

    def _exempt(self, user: str) -> bool:
        return self.limiter.limit_source(user).kind == "exempt"

    def _charged_rate(self, user: str) -> int:
        """For the teams' budget: nonzero when ``user`` is charged to its team
        (a member without a prompt rate of its own is, unless exempt)."""
        rate = self.limiter.rate_of(user)
        if rate or self._exempt(user):
            return rate
        return MAX_RATE
