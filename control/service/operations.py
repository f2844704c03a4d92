"""The control plane's operations, free of gRPC: the one object the servicer,
the runner and the config-file persistence call.

``LimitsService`` holds the table's commit machinery (``commits``) and the page
tokens, and hands each operation to the module of its concern:

- ``holders``: the verbs of every kind of rate holder (``control.kinds``:
  user entries, tiers, teams): get, list, create, update, delete;
- ``reads``: the default, the mode, the whole table;
- ``writes``: changes of the default or the mode;
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

from collections.abc import Callable, Iterable, Mapping, Sequence

from control.kinds import Kind
from control.pagination import PageTokens
from control.resources import (
    Holder,
    HolderSpec,
    LimitsTable,
    PacingMode,
    TeamState,
    UserState,
)
from control.service import (
    holders,
    reads,
    table_writes,
    team_states,
    user_states,
    writes,
)
from control.service.commits import TableCommits
from control.service.user_states import (
    WatchPlan,
)
from pacing.modes import Mode
from pacing.policy.model import Limits, Policy
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
        persist: Callable[[Policy], None] | None = None,
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

    def get_default(self, name: str) -> Limits:
        """The default's limits (no rate while pacing is off)."""
        return reads.get_default(self._commits, name)

    def update_default(
        self, name: str, values: Mapping[str, object], update_mask: Sequence[str] = ()
    ) -> Limits:
        """Changes the default's attributes (wire values: 0 for not set) that
        ``update_mask`` selects; returns the default. See
        ``writes.update_default``."""
        return writes.update_default(self._commits, name, values, update_mask)

    # -- the holders of every kind ------------------------------------------

    def get(self, kind: Kind, name: str) -> Holder:
        """The holder named ``{collection}/{id}``; NotFound without one."""
        return holders.get(self._commits, kind, name)

    def list_page(
        self, kind: Kind, page_size: int, page_token: str
    ) -> tuple[list[Holder], str]:
        """One page of holders in id order, and the next page's token (""
        on the last page)."""
        return holders.list_page(
            self._commits, kind, self._tokens, page_size, page_token
        )

    def create(
        self, kind: Kind, holder_id: str, values: Mapping[str, object]
    ) -> Holder:
        """Creates holder ``holder_id`` with the fields ``values`` sets (wire
        values: 0, false or "" for not set); AlreadyExists if it exists."""
        return holders.create(self._commits, kind, holder_id, values)

    def update(
        self,
        kind: Kind,
        name: str,
        values: Mapping[str, object],
        update_mask: Sequence[str] = (),
        *,
        allow_missing: bool = False,
        etag: str = "",
    ) -> Holder:
        """Changes the fields of holder ``name`` that ``update_mask`` selects
        (empty: those set); see ``holders.update``."""
        return holders.update(
            self._commits,
            kind,
            name,
            values,
            update_mask,
            allow_missing=allow_missing,
            etag=etag,
        )

    def delete(
        self, kind: Kind, name: str, *, allow_missing: bool = False, etag: str = ""
    ) -> None:
        """Removes holder ``name``; FailedPrecondition while a group has
        members."""
        holders.delete(
            self._commits, kind, name, allow_missing=allow_missing, etag=etag
        )

    # -- team state --------------------------------------------------------

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
        holders: Mapping[Kind, Iterable[HolderSpec]],
        etag: str = "",
        default: Mapping[str, object] | None = None,
        *,
        bands: Sequence[str] = (),
        objectives: Sequence[tuple[str, str]] = (),
    ) -> LimitsTable:
        """Replaces the default (``default``: each of its attributes, as the
        wire gives them), every holder of every kind, weights included, the
        bands and the objectives (name, band: in the request's order) at once
        (not the mode nor the fair-share switch); Aborted when ``etag`` is not
        empty and not the current etag."""
        return table_writes.replace_limits_table(
            self._commits,
            default_tokens_per_second,
            holders,
            etag,
            default,
            bands=bands,
            objectives=objectives,
        )

    def reload(self, read: Callable[[], Policy | None]) -> bool:
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
