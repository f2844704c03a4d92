"""Resource names of the API (AIP-122): ``limits/{user}``, ``tiers/{tier}``,
``teams/{team}``, ``userStates/{user}``, ``teamStates/{team}`` and the
singletons ``defaultLimit``, ``limitsTable`` and ``pacingMode``.

The user, tier or team id is everything after the collection prefix, verbatim:
ids may contain ``/``, and escaping them would make names differ from the ids
operators type. It must be valid by ``pacing.identity.validate_user`` (tier and
team ids follow the same rule). Error messages show names through ``shown``
(bounded, escaped).
"""

from __future__ import annotations

from control.errors import InvalidArgument
from control.table import check_team, check_tier, check_user, shown

LIMITS = "limits/"
TIERS = "tiers/"
TEAMS = "teams/"
USER_STATES = "userStates/"
TEAM_STATES = "teamStates/"
DEFAULT_LIMIT = "defaultLimit"
LIMITS_TABLE = "limitsTable"
PACING_MODE = "pacingMode"


def limit_name(user: str) -> str:
    """``limits/{user}``."""
    return LIMITS + user


def limit_user(name: str) -> str:
    """The user id in ``limits/{user}``, a name the server sent (it checked the
    id, so it is not checked again)."""
    return name.removeprefix(LIMITS)


def tier_name(tier: str) -> str:
    """``tiers/{tier}``."""
    return TIERS + tier


def tier_id(name: str) -> str:
    """The tier id in ``tiers/{tier}``, a name the server sent (not checked
    again); ``""`` for ``""`` (no tier)."""
    return name.removeprefix(TIERS)


def team_name(team: str) -> str:
    """``teams/{team}``."""
    return TEAMS + team


def team_id(name: str) -> str:
    """The team id in ``teams/{team}``, a name the server sent (not checked
    again); ``""`` for ``""`` (no team)."""
    return name.removeprefix(TEAMS)


def team_state_name(team: str) -> str:
    """``teamStates/{team}``."""
    return TEAM_STATES + team


def user_state_name(user: str) -> str:
    """``userStates/{user}``."""
    return USER_STATES + user


def parse_user(name: str, prefix: str, *, field: str) -> str:
    """The user id of ``{prefix}{user}``; InvalidArgument naming ``field`` when
    ``name`` has another form or the id is invalid."""
    if not name.startswith(prefix):
        raise InvalidArgument(
            f"{field} must look like {prefix}{{user}}, got {shown(name)}"
        )
    return check_user(name[len(prefix) :], field=f"user id in {field}")


def parse_tier(name: str, *, field: str) -> str:
    """The tier id of ``tiers/{tier}``; InvalidArgument naming ``field`` when
    ``name`` has another form or the id is invalid."""
    if not name.startswith(TIERS):
        raise InvalidArgument(
            f"{field} must look like {TIERS}{{tier}}, got {shown(name)}"
        )
    return check_tier(name[len(TIERS) :], field=f"tier id in {field}")


def parse_team(name: str, prefix: str = TEAMS, *, field: str) -> str:
    """The team id of ``{prefix}{team}`` (``teams/`` or ``teamStates/``);
    InvalidArgument naming ``field`` when ``name`` has another form or the id
    is invalid."""
    if not name.startswith(prefix):
        raise InvalidArgument(
            f"{field} must look like {prefix}{{team}}, got {shown(name)}"
        )
    return check_team(name[len(prefix) :], field=f"team id in {field}")


def check_singleton(name: str, expected: str, *, field: str) -> None:
    """Accepts ``expected`` or an empty name (singletons need no name)."""
    if name not in ("", expected):
        raise InvalidArgument(
            f"{field} must be {expected!r} or empty, got {shown(name)}"
        )
