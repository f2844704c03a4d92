"""One paced step's grants: who was given, charged and refused which tokens.

Each user with demand is asked once per step for a *grant*: up to as many
tokens as its live requests may take (``BudgetSource.take_up_to``; one each, or
1 + the draft tokens of a speculative step). The grant is handed out one token
per sampling request in service order, and a request is charged at most once
per step. With speculative decoding a charged request may then take more of the
grant for the draft tokens it verifies, as long as one token is kept for each of
the user's requests not served yet (``charge_drafts``); the drafts it is not
given are not scheduled. Whatever is left, or was handed to a request that was
not dispatched, is given back when the step settles
(``engine_ext.scheduling.settlement``); drafts the model rejects are given back
once the step's output is known (``engine_ext.scheduling.drafts``).

With teams (``pacing.teams``) a member's grant is taken with those of all its
team's members with live requests, at its first use in the step, so that the
team's tokens are split among them by weight rather than by who asks first.

Invariant: the budget source is asked at most once per user and step, and for
every user ``granted = left + tokens charged``, so nothing is handed out twice
or lost before settlement.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine_ext.scheduling.step_accounting import ThrottleEpisodes
from engine_ext.scheduling.users import UserBook
from pacing.budget import BudgetSource
from pacing.identity import ANONYMOUS_USER
from pacing.teams import TeamGrants

if TYPE_CHECKING:
    from engine_ext.scheduling.upstream import Request


class PacedStep:
    """Bookkeeping of one paced ``schedule()`` call."""

    __slots__ = (
        "biased_arrival",
        "book",
        "budget",
        "capped",
        "charged",
        "drafts",
        "episodes",
        "granted",
        "left",
        "needy_pending",
        "now_ns",
        "parked",
        "refused",
        "remaining",
        "running_granted",
        "running_throttled",
        "served",
        "shadow",
        "shadow_skips",
        "skips",
        "spare_slots",
        "team_members",
        "teams",
        "user_of",
    )

    def __init__(
        self,
        now_ns: int,
        budget: BudgetSource,
        book: UserBook,
        *,
        capped: bool,
        shadow: bool = False,
        episodes: ThrottleEpisodes | None = None,
    ) -> None:
        self.now_ns = now_ns
        self.budget = budget
        self.book = book
        self.user_of = book.user_of
        #: Where refusals are recorded per request (request tracing on), or None.
        self.episodes = episodes
        self.left: dict[str, int] = {}  #: user -> tokens of its grant not handed out
        self.granted: dict[str, int] = {}  #: user -> its grant
        #: user -> tokens it had beyond its grant (0: the grant took them all).
        self.remaining: dict[str, int] = {}
        self.charged: dict[str, str] = {}  #: request id -> user, in service order
        #: request id -> draft tokens charged beyond its one token.
        self.drafts: dict[str, int] = {}
        #: user -> its requests charged so far (kept only when drafts may be
        #: charged: ``book.step_tokens > 1``).
        self.served: dict[str, int] | None = {} if book.step_tokens > 1 else None
        self.refused: set[str] = set()  #: users refused a token in this step
        self.skips: dict[str, int] = {}  #: user -> requests passed over
        #: Whether the active cap is below the slot count (only then does the
        #: running loop count granted and throttled requests).
        self.capped = capped
        self.running_granted = 0  # running requests given tokens this step
        self.running_throttled = 0  # running requests skipped for lack of budget
        #: Shadow mode: a refusal is counted in ``shadow_skips`` (user -> n) and
        #: the request runs uncharged.
        self.shadow = shadow
        self.shadow_skips: dict[str, int] = {}
        #: request id -> its arrival time while biased for PRIORITY's victim choice.
        self.biased_arrival: dict[str, float] = {}
        self.parked: list[Request] = []  # in rotated order
        #: Slots a refused user's waiting request may take for a prefill that stops
        #: short of sampling; None: no user with budget is waiting for a slot.
        self.spare_slots: int | None = None
        #: Waiting requests of users with budget that the waiting loop has yet to
        #: reach; no refused user's request is admitted ahead of them.
        self.needy_pending: set[str] = set()
        #: The budget when it knows teams (their members are granted together).
        self.teams = budget if isinstance(budget, TeamGrants) else None
        #: team -> its members with live requests (built at the first team grant).
        self.team_members: dict[str, list[str]] | None = None

    def tokens_left(self, user: str) -> int:
        """Tokens of ``user``'s grant not yet handed out in this step; takes the
        grant on first use (one budget call per user and step)."""
        left = self.left.get(user)
        if left is None:
            book = self.book
            teams = self.teams
            team = None if teams is None else teams.team_of(user)
            if team is not None:
                return self._grant_team(team, user)
            left, remaining = self.budget.take_up_to(
                user, book.live.get(user, 1) * book.step_tokens, self.now_ns
            )
            self.left[user] = self.granted[user] = left
            self.remaining[user] = remaining
        return left

    def _grant_team(self, team: str, user: str) -> int:
        """Takes the grants of ``user`` and of every other member of ``team``
        with live requests at once; returns ``user``'s."""
        teams = self.teams
        assert teams is not None
        members = self.team_members
        if members is None:
            members = self.team_members = {}
            team_of = teams.team_of
            for member in self.book.live:
                member_team = team_of(member)
                if member_team is not None:
                    members.setdefault(member_team, []).append(member)
        live = self.book.live
        step_tokens = self.book.step_tokens
        demands = {m: live[m] * step_tokens for m in members.get(team, ())}
        demands.setdefault(user, live.get(user, 1) * step_tokens)
        for member, (taken, remaining) in teams.take_team(
            team, demands, self.now_ns
        ).items():
            self.left[member] = self.granted[member] = taken
            self.remaining[member] = remaining
        return self.left[user]

    def has_budget(self, user: str) -> bool:
        """Whether ``user`` could be charged another token now (its grant is
        capped by its live requests, so an empty grant alone does not say)."""
        return bool(self.tokens_left(user)) or bool(self.remaining[user])

    def charge(self, request: Request) -> bool:
        """Hands the request one token of its user's grant for this step (a
        request is charged at most once per step); False: refused."""
        request_id = request.request_id
        if request_id in self.charged:
            return True
        user = self.user_of.get(request_id, ANONYMOUS_USER)
        left = self.left.get(user)
        if left is None:
            left = self.tokens_left(user)
        if left:
            self.left[user] = left - 1
            self.charged[request_id] = user
            if self.served is not None:
                self.served[user] = self.served.get(user, 0) + 1
            return True
        if self.shadow:
            self.shadow_skips[user] = self.shadow_skips.get(user, 0) + 1
            return True
        self.refused.add(user)
        self.passed_over(request, user)
        return False

    def charge_drafts(self, request: Request, drafts: int) -> int:
        """Hands a request charged in this step up to ``drafts`` more tokens of
        its user's grant, for the draft tokens its step verifies (each may
        become an output token), keeping one token for each of the user's live
        requests not charged yet; returns how many (0 when it was not charged)."""
        request_id = request.request_id
        user = self.charged.get(request_id)
        if user is None or self.served is None:
            return 0
        unserved = self.book.live.get(user, 0) - self.served[user]
        given = max(0, min(drafts, self.left[user] - unserved))
        if given:
            self.left[user] -= given
            self.drafts[request_id] = self.drafts.get(request_id, 0) + given
        return given

    def passed_over(self, request: Request, user: str) -> None:
        """Counts a request passed over for lack of budget in this step."""
        self.skips[user] = self.skips.get(user, 0) + 1
        if self.episodes is not None:
            self.episodes.passed_over(request.request_id, self.now_ns)
