"""The control plane's operations, free of gRPC: the one object the servicer,
the runner and the config-file persistence call.

``LimitsService`` holds the table's commit machinery (``commits``) and the page
tokens, and hands each operation to the module of its concern:

- ``reads``: the default, entries, tiers, teams, the mode, the whole table;
- ``writes``: changes of the default, an entry, a tier, a team or the mode;
- ``table_writes``: replacing the whole table, reloading it from the config
  file;
- ``write_requests``: the checks of a write request's own fields;
- ``user_states``: per-user state reads and watches;
- ``team_states``: per-team state reads;
- ``commits``: the locks, the durable write or global publication, the apply
  and the table etag that every change goes through;
- ``resources``: what the operations take and return, with their etags;
- ``ordering``: page sizes and the order of user states.

Invariant: the service keeps no state of its own beyond ``commits`` and the page
tokens; every answer is read from, and every change made to, ``shared``'s
limiter (see ``commits`` for the order of a change). An entry and a tier carry
an etag computed from their fields; the table's etag moves with every committed
change of the table, the mode's with the mode.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from control.pagination import PageTokens
from control.resources import (
    Limit,
    LimitSpec,
    LimitsTable,
    PacingMode,
    Team,
    TeamSpec,
    TeamState,
    Tier,
    TierSpec,
    UserState,
)
from control.service import reads, table_writes, team_states, user_states, writes
from control.service.commits import TableCommits
from control.service.user_states import (
    WatchPlan,
)
from control.table import TableDocument
from pacing.modes import Mode
from pacing.shared import SharedLimiter


class LimitsService:
    """Reads and changes the limits and the mode of ``shared``'s limiter; see
    the module docstring.

    ``persist``, when given, durably stores a whole new table (with the mode)
    before it is applied (raises OSError on failure). ``page_tokens`` signs page
    tokens (a fresh random key by default). ``global_store``: a store holds the
    table (see ``control.service.commits``); changes are refused until its backend is
    registered.
    """

    def __init__(
        self,
        shared: SharedLimiter,
        *,
        persist: Callable[[TableDocument], None] | None = None,
        page_tokens: PageTokens | None = None,
        global_store: bool = False,
    ) -> None:
        self._shared = shared
        self._tokens = page_tokens or PageTokens()
        self._commits = TableCommits(shared, persist=persist, global_store=global_store)

    @property
    def limit_changes(self) -> int:
        """How many new tables were committed: one per successful write RPC of
        the table (even one that leaves it as it was; not a mode change) and one
        per load of the config file that changed the table, the load at start-up
        included, and, with a global store, one per table from another engine
        applied here."""
        return self._commits.generation

    # -- the default -------------------------------------------------------

    def get_default_limit(self, name: str) -> int:
        """The default limit in tokens/s (0 while pacing is off)."""
        return reads.get_default_limit(self._commits, name)

    def update_default_limit(
        self, name: str, tokens_per_second: int, update_mask: Sequence[str]
    ) -> int:
        """Sets the default limit; returns it."""
        return writes.update_default_limit(
            self._commits, name, tokens_per_second, update_mask
        )

    # -- one user's entry --------------------------------------------------

    def get_limit(self, name: str) -> Limit:
        """The entry named ``limits/{user}``; NotFound without one."""
        return reads.get_limit(self._commits, name)

    def create_limit(
        self,
        limit_id: str,
        tokens_per_second: int,
        *,
        tier: str = "",
        exempt: bool = False,
        weight: float = 0.0,
        team: str = "",
    ) -> Limit:
        """Gives user ``limit_id`` an entry; AlreadyExists if it has one."""
        return writes.create_limit(
            self._commits,
            limit_id,
            tokens_per_second,
            tier=tier,
            exempt=exempt,
            weight=weight,
            team=team,
        )

    def update_limit(
        self,
        name: str,
        tokens_per_second: int,
        update_mask: Sequence[str],
        *,
        allow_missing: bool,
        tier: str = "",
        exempt: bool = False,
        etag: str = "",
        weight: float = 0.0,
        team: str = "",
    ) -> Limit:
        """Changes the fields of entry ``name`` that ``update_mask`` selects;
        see ``writes.update_limit``."""
        return writes.update_limit(
            self._commits,
            name,
            tokens_per_second,
            update_mask,
            allow_missing=allow_missing,
            tier=tier,
            exempt=exempt,
            etag=etag,
            weight=weight,
            team=team,
        )

    def delete_limit(self, name: str, *, allow_missing: bool, etag: str = "") -> None:
        """Removes the entry ``name`` (the default applies again)."""
        writes.delete_limit(self._commits, name, allow_missing=allow_missing, etag=etag)

    def list_limits(self, page_size: int, page_token: str) -> tuple[list[Limit], str]:
        """One page of entries in user id order, and the next page's token (""
        on the last page)."""
        return reads.list_limits(self._commits, self._tokens, page_size, page_token)

    # -- tiers -------------------------------------------------------------

    def get_tier(self, name: str) -> Tier:
        """The tier named ``tiers/{tier}``; NotFound without one."""
        return reads.get_tier(self._commits, name)

    def list_tiers(self, page_size: int, page_token: str) -> tuple[list[Tier], str]:
        """One page of tiers in tier id order, and the next page's token (""
        on the last page)."""
        return reads.list_tiers(self._commits, self._tokens, page_size, page_token)

    def create_tier(
        self, tier_id: str, tokens_per_second: int, exempt: bool, weight: float = 0.0
    ) -> Tier:
        """Creates tier ``tier_id``; AlreadyExists if it exists."""
        return writes.create_tier(
            self._commits, tier_id, tokens_per_second, exempt, weight
        )

    def update_tier(
        self,
        name: str,
        tokens_per_second: int,
        exempt: bool,
        update_mask: Sequence[str],
        *,
        allow_missing: bool,
        etag: str = "",
        weight: float = 0.0,
    ) -> Tier:
        """Changes the fields of tier ``name`` that ``update_mask`` selects;
        see ``writes.update_tier``."""
        return writes.update_tier(
            self._commits,
            name,
            tokens_per_second,
            exempt,
            update_mask,
            allow_missing=allow_missing,
            etag=etag,
            weight=weight,
        )

    def delete_tier(self, name: str, *, allow_missing: bool, etag: str = "") -> None:
        """Removes tier ``name``; FailedPrecondition while it has members."""
        writes.delete_tier(self._commits, name, allow_missing=allow_missing, etag=etag)

    # -- teams -------------------------------------------------------------

    def get_team(self, name: str) -> Team:
        """The team named ``teams/{team}``; NotFound without one."""
        return reads.get_team(self._commits, name)

    def list_teams(self, page_size: int, page_token: str) -> tuple[list[Team], str]:
        """One page of teams in team id order, and the next page's token (""
        on the last page)."""
        return reads.list_teams(self._commits, self._tokens, page_size, page_token)

    def create_team(
        self, team_id: str, tokens_per_second: int, weight: float = 0.0
    ) -> Team:
        """Creates team ``team_id``; AlreadyExists if it exists."""
        return writes.create_team(self._commits, team_id, tokens_per_second, weight)

    def update_team(
        self,
        name: str,
        tokens_per_second: int,
        update_mask: Sequence[str],
        *,
        allow_missing: bool,
        etag: str = "",
        weight: float = 0.0,
    ) -> Team:
        """Changes the fields of team ``name`` that ``update_mask`` selects;
        see ``writes.update_team``."""
        return writes.update_team(
            self._commits,
            name,
            tokens_per_second,
            update_mask,
            allow_missing=allow_missing,
            etag=etag,
            weight=weight,
        )

    def delete_team(self, name: str, *, allow_missing: bool, etag: str = "") -> None:
        """Removes team ``name``; FailedPrecondition while it has members."""
        writes.delete_team(self._commits, name, allow_missing=allow_missing, etag=etag)

    def get_team_state(self, name: str) -> TeamState:
        """The state of the team named ``teamStates/{team}``; NotFound when
        there is no such team."""
        return team_states.get_team_state(self._shared, name)

    def list_team_states(
        self, page_size: int, page_token: str
    ) -> tuple[list[TeamState], str]:
        """One page of team states in team id order, and the next page's token
        ("" on the last page)."""
        return team_states.list_team_states(
            self._shared, self._tokens, page_size, page_token
        )

    # -- the pacing mode and the fair-share switch --------------------------

    def get_pacing_mode(self, name: str) -> PacingMode:
        """The pacing mode and the fair-share switch, with their etag."""
        return reads.get_pacing_mode(self._commits, name)

    def update_pacing_mode(
        self,
        name: str,
        mode: Mode | None,
        update_mask: Sequence[str],
        *,
        etag: str = "",
        fair_share: bool = False,
        mode_set: bool | None = None,
    ) -> PacingMode:
        """Switches the pacing mode and fair share as ``update_mask`` selects
        (``mode`` None: unset, or a value we do not know, refused where the mode
        is to change; ``mode_set``: whether the request holds one, by default
        whether ``mode`` is given). See ``writes.update_pacing_mode``."""
        return writes.update_pacing_mode(
            self._commits,
            name,
            mode,
            update_mask,
            etag=etag,
            fair_share=fair_share,
            mode_set=mode is not None if mode_set is None else mode_set,
        )

    # -- the whole table ---------------------------------------------------

    def get_limits_table(self, name: str) -> LimitsTable:
        """The default, every entry, every tier and every team, with the
        current etag."""
        return reads.get_limits_table(self._commits, name)

    def replace_limits_table(
        self,
        default_tokens_per_second: int,
        limits: Iterable[LimitSpec],
        etag: str,
        tiers: Iterable[TierSpec] = (),
        teams: Iterable[TeamSpec] = (),
    ) -> LimitsTable:
        """Replaces the default, all entries, all tiers and all teams, weights
        included, at once (not the mode nor the fair-share switch); Aborted
        when ``etag`` is not empty and not the current etag."""
        return table_writes.replace_limits_table(
            self._commits, default_tokens_per_second, limits, etag, tiers, teams
        )

    def reload(self, read: Callable[[], TableDocument | None]) -> bool:
        """Makes the document ``read()`` returns the table and mode, without
        persisting it; returns whether the table or the mode changed. See
        ``table_writes.reload``."""
        return table_writes.reload(self._commits, read)

    # -- user state --------------------------------------------------------

    def get_user_state(self, name: str) -> UserState:
        """The state of the user named ``userStates/{user}``; NotFound for a user
        the limiter does not know."""
        return user_states.get_user_state(self._shared, name)

    def list_user_states(
        self, page_size: int, page_token: str, order_by: str
    ) -> tuple[list[UserState], str]:
        """One page of user states in ``order_by`` order, and the next page's
        token ("" on the last page)."""
        return user_states.list_user_states(
            self._shared, self._tokens, page_size, page_token, order_by
        )

    def plan_watch(
        self,
        interval_ns: int | None,
        state_names: Sequence[str],
        order_by: str,
        max_users: int,
    ) -> WatchPlan:
        """Validates a watch request (``interval_ns`` None: unset)."""
        return user_states.plan_watch(interval_ns, state_names, order_by, max_users)

    def watch_states(self, plan: WatchPlan) -> list[UserState]:
        """The states one update of ``plan`` holds, read at one instant."""
        return user_states.watch_states(self._shared, plan)
