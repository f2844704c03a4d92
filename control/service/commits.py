"""The policy in force and how a change of it is committed: the change lock,
the durable write (config file) or the publication (global store), the apply
to the limiter, the teams and the ledger together with the policy in force
(``SharedLimiter.policy``), the table etag.

Every read and write goes through ``SharedLimiter.lock`` (see
``pacing.shared``). Changes are also serialised among themselves by a second
lock, ``TableCommits.changes``, held while the new table is written to the
config file; the scheduler never waits for that write, only for the in-memory
apply. Order of a change: validate against the current table, write the whole
new table and mode (``persist``), apply the change to the limiter (or the mode
to the shared limiter) and bump the etag under the shared limiter's lock, then
``wake()`` the engine. A failed write applies nothing.

The teams (rates and memberships) are part of every document too and apply to
the shared limiter's ``Teams`` in the same hold of its lock (``TeamsApply``).
The table's fair-share weights and the fair-share switch (``SharePolicy``) are
part of every document and apply to the shared limiter's ledger with the rest;
a document that switches fair share on where the engine refuses it
(``FairShare.refusal``) is refused before anything is written
(FAILED_PRECONDITION).

The change lock is the engine's ``pacing.global_limits`` hub lock. With a
global store (``--output-rate-store``) the store takes the file's place: the
whole new table, mode and fair-share policy are published through the hub's
backend
(compare-and-set against the version this engine holds) before they are
applied here. Another engine's change that came first answers ABORTED (this
engine has applied it: read again and retry); a store that does not answer, or
no backend yet, answers UNAVAILABLE and applies nothing. The backend saves a
published table to the engine's limits file with its store version; when that
save fails the change is every engine's already: it is applied here too and
the answer is UNAVAILABLE saying so, never OK. A table another engine
published and this engine applied moves the table etag, as a local change does.

Invariant: a change that was not persisted (or published) is not applied; the
table etag moves, under ``shared.lock``, with every table applied, and a mode
change alone does not move it; ``shared.policy`` is replaced in the same hold
of the lock as the runtime tables, so it is always what they were built from.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Callable, Iterable

from control.errors import Aborted, FailedPrecondition, Unavailable
from control.resources import Etags
from control.table import table_in_force
from pacing import global_limits
from pacing.fair_share_policy import apply_policy
from pacing.limiter import OutputRateLimiter
from pacing.policy.document import FAIR_SHARE_KEY
from pacing.policy.model import Policy
from pacing.shared import SharedLimiter
from pacing.teams import Teams

#: Applies a change to the limiter at ``now_ns``; runs under the shared lock.
Apply = Callable[[OutputRateLimiter, int], None]
#: Applies a change to the teams at ``now_ns``; runs under the shared lock.
TeamsApply = Callable[[Teams, int], None]


class TableCommits:
    """The table and mode of ``shared``'s limiter, and the one way to change
    them (see the module docstring).

    ``persist``, when given, durably stores a whole new table (with the mode)
    before it is applied (raises OSError on failure). ``global_store``: a store
    holds the table; changes are refused until its backend is registered.
    """

    def __init__(
        self,
        shared: SharedLimiter,
        *,
        persist: Callable[[Policy], None] | None,
        global_store: bool,
    ) -> None:
        self.shared = shared
        self._persist = persist
        self._hub = global_limits.hub(shared)
        self._global_store = global_store
        #: Serialises changes among themselves (the hub's lock).
        self.changes = self._hub.lock
        self._hub.on_table_change(self._changed_elsewhere)
        # The etag: random per process, so an etag from before a restart never
        # matches, plus a generation bumped with every change under shared.lock.
        epoch = secrets.token_hex(4)
        self._epoch = epoch
        self._generation = 0
        self.etags = Etags(epoch)

    @property
    def generation(self) -> int:
        """How many tables were applied (see ``LimitsService.limit_changes``)."""
        return self._generation

    def etag(self) -> str:
        """The table's etag. Requires shared.lock (or self.changes)."""
        return f"{self._epoch}-{self._generation}"

    def current(self) -> Policy:
        with self.shared.lock:
            return self.current_locked()

    def current_locked(self) -> Policy:
        """The table, mode and fair-share policy in force, as a document of
        copies (default None while pacing is off). Requires shared.lock."""
        return table_in_force(self.shared)

    def commit(
        self,
        policy: Policy,
        apply: Apply | None,
        *,
        table: bool = True,
        teams: TeamsApply | None = None,
    ) -> str:
        """Persists ``policy`` (the whole new table and mode), applies it (``apply``
        to the limiter, ``teams`` to the teams) and announces it; returns the
        table's etag. Requires self.changes."""
        self.check_fair_share(policy, field=f"pacing_mode.{FAIR_SHARE_KEY}")
        backend = self._hub.backend
        if backend is not None or self._global_store:
            try:
                self._publish(backend, policy)
            except global_limits.LimitsNotSaved as exc:
                # Every engine's table now: applied here too, but not acknowledged.
                self.apply(policy, apply, table=table, teams=teams)
                self.shared.wake()
                raise Unavailable(
                    f"{exc}: it is applied, but would not survive the store losing "
                    "its data unless another engine saved it"
                ) from None
        elif self._persist is not None:
            try:
                self._persist(policy)
            except OSError as exc:
                raise Unavailable(
                    f"the change was not applied: writing the config file failed: {exc}"
                ) from None
        etag = self.apply(policy, apply, table=table, teams=teams)
        self.shared.wake()
        return etag

    def commit_table(
        self,
        policy: Policy,
        *,
        users: Iterable[str] | None = None,
        teams: TeamsApply | None = None,
    ) -> str:
        """Commits ``policy`` as the whole new table (``commit``), applied as if
        each difference from the table in force were set one by one. ``users``
        and ``teams``, when given, say what differs: the only users whose
        limit may change, and the change of the teams. Requires self.changes."""
        if users is None:
            teams = replace_teams(policy, self.current())
        return self.commit(policy, replace_with(policy, users), teams=teams)

    def check_fair_share(self, policy: Policy, *, field: str) -> None:
        """FailedPrecondition naming ``field`` when ``policy`` switches fair share
        on and the engine cannot run it."""
        refusal = self.shared.fair_share.refusal
        if policy.fair_share and refusal is not None:
            raise FailedPrecondition(f"{field}: fair share cannot run here: {refusal}")

    def apply(
        self,
        policy: Policy,
        apply: Apply | None,
        *,
        table: bool,
        teams: TeamsApply | None = None,
    ) -> str:
        """Runs ``apply`` on the limiter and ``teams`` on the teams, makes
        ``policy`` the policy in force, its mode (when given) the mode, its
        weights and switch (when given) the ledger's and, for a change of the
        table, bumps the etag; returns it. Requires self.changes."""
        shared = self.shared
        share = policy.share_policy(shared.fair_share.enabled)
        in_force = dataclasses.replace(policy, mode=None, fair_share=None)
        with shared.lock:
            now_ns = shared.clock()
            if apply is not None:
                apply(shared.limiter, now_ns)
            if teams is not None:
                teams(shared.teams, now_ns)
            if policy.mode is not None:
                shared.mode = policy.mode
            apply_policy(shared.fair_share, share)
            shared.policy = in_force
            if table:
                self._generation += 1
            return self.etag()

    def _publish(
        self, backend: global_limits.LimitsBackend | None, policy: Policy
    ) -> None:
        """Makes ``policy`` every engine's through the store. Requires
        self.changes (the hub's lock)."""
        if backend is None:
            raise Unavailable(
                "the change was not applied: the limits store is not connected yet"
            )
        assert policy.mode is not None  # current() always reads the mode
        try:
            backend.publish(
                dataclasses.replace(
                    policy,
                    fair_share=policy.share_policy(
                        self.shared.fair_share.enabled
                    ).enabled,
                )
            )
        except global_limits.LimitsConflict:
            raise Aborted(
                "the limits table was changed through another engine since this "
                "engine read it; it is applied here now: read it again and retry"
            ) from None
        except global_limits.LimitsUnavailable as exc:
            raise Unavailable(
                f"the change was not applied: the limits store did not take it: {exc}"
            ) from None

    def _changed_elsewhere(self) -> None:
        """A table from another engine was applied: the table etag moves.
        Called with shared.lock held."""
        self._generation += 1


def replace_with(policy: Policy, users: Iterable[str] | None = None) -> Apply:
    """Applies the default and the whole table of ``policy`` (the core's table
    is built here, off the scheduler lock); ``users``: the only users whose
    limit may differ (None: any)."""
    table = policy.limit_table()
    default = policy.default_rate

    def apply(limiter: OutputRateLimiter, now_ns: int) -> None:
        if default is not None and default != limiter.default_rate:
            limiter.set_default_rate(default, now_ns)
        limiter.replace_limits(table, now_ns, users)

    return apply


def replace_teams(policy: Policy, current: Policy) -> TeamsApply | None:
    """Makes the teams of ``policy`` the teams (the table built here, off the
    scheduler lock); None when they are those of ``current``."""
    table = policy.team_table()
    held = current.team_table()
    if (table.rates, table.memberships) == (held.rates, held.memberships):
        return None

    def apply(teams: Teams, now_ns: int) -> None:
        teams.replace(table, now_ns)

    return apply
