"""The limits table in Redis: one JSON document with a version, replaced
atomically by ``PUT``, which makes a new version and publishes it, so that
every engine learns of a change at once (and, should a message be lost, from
the version the next time it reads).

The version (``pacing.global_limits.LimitsVersion``) is two fields of the
table's hash: ``version``, a counter, and ``stamp``, drawn at random by each
writer. ``PUT``'s compare-and-set compares both, so a writer holding a version
from before the store lost data (a FLUSHALL, a restart without persistence, a
failover's rolled-back writes) is refused even where the counter, counting
again, reached the same number.

The document is the operator's policy (``pacing.policy.model.Policy``) in the
store's flat form (``pacing.policy.flat``), as engines of earlier versions
write and read it: the default rate, the ``pacing.limits.LimitTable`` pieces,
the pacing mode (the fleet's kill switch is one switch), the fair-share switch
and weights (the counters stay each engine's) and the teams. The fair-share
keys are written only when fair share is on or there is a weight, the teams'
only when there is a team, the priority bands (``bands``, highest first) and
the gateway's objectives (``objectives``: objective -> band) only when there
are some, so documents of fleets that use none of them stay as they were. An
attribute the pieces do not carry (``pacing.policy.flat.CARRIED``: a holder's
``band`` among them)
is written under ``attributes``, in the policy document's object form, only
when a holder sets one: engines of earlier versions refuse such a document
(an unknown field) and keep their table, so set such an attribute once every
engine runs a version that knows it. Decoding checks the document with the
one validator of every entry point (``pacing.policy``: its flat form, then the
document's rules), so a bad document is refused, never applied.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Final

from pacing.modes import Mode
from pacing.policy.document import (
    BANDS_KEY,
    OBJECTIVES_KEY,
    WEIGHT_KEYS,
    check_keys,
    check_object,
    parse,
)
from pacing.policy.errors import PolicyError
from pacing.policy.flat import (
    ATTRIBUTES_KEY,
    CARRIED,
    attributes_of,
    tree_of,
    with_attributes,
)
from pacing.policy.model import Policy

#: KEYS[1]: the limits hash. ARGV: the counter and stamp of the version the
#: writer read ('' for any; '0' and '' where there must be no table), the new
#: stamp, a counter to count past besides the current one (a writer restoring
#: a newer table than the store's), the document, the channel to publish the
#: new counter on. Returns ``{1, counter, stamp}`` of the new version, or
#: ``{0, counter, stamp}`` of the current one when the writer's is stale.
PUT: Final = """
local current = redis.call('HMGET', KEYS[1], 'version', 'stamp')
local counter = tonumber(current[1] or '0')
local stamp = current[2] or ''
if ARGV[1] ~= '' and (tonumber(ARGV[1]) ~= counter or ARGV[2] ~= stamp) then
  return {0, counter, stamp}
end
counter = math.max(counter, tonumber(ARGV[4])) + 1
redis.call('HSET', KEYS[1], 'version', counter, 'stamp', ARGV[3], 'document', ARGV[5])
redis.call('PUBLISH', ARGV[6], counter)
return {1, counter, ARGV[3]}
"""

_FIELDS = (
    "default_rate",
    "user_rates",
    "tier_rates",
    "memberships",
    "exempt_users",
    "exempt_tiers",
    "mode",
)
#: Written only when set (see the module docstring).
_POLICY_FIELDS = ("fair_share", "weights")
#: The teams (``pacing.teams``), written only when there is a team.
_TEAM_FIELDS = ("team_rates", "team_members")
#: The priority bands and the objectives (``pacing.bands``), written only when
#: set: the policy document's own keys.
_BAND_FIELDS = (BANDS_KEY, OBJECTIVES_KEY)


def encode(policy: Policy, carried: tuple[str, ...] = CARRIED) -> str:
    """``policy`` as the stored JSON document (keys sorted: equal tables give
    equal documents): the pieces for the attributes of ``carried``, the others
    under ``attributes`` (``pacing.policy.flat.attributes_of``). ValueError
    where the policy does not say its mode and fair-share switch (a stored
    table says both)."""
    if policy.mode is None or policy.fair_share is None:
        raise ValueError("a stored limits table says its mode and fair-share switch")
    table, share = policy.limit_table(), policy.share_policy()
    document: dict[str, Any] = {
        "default_rate": policy.default_rate,
        "user_rates": table.user_rates,
        "tier_rates": table.tier_rates,
        "memberships": table.memberships,
        "exempt_users": sorted(table.exempt_users),
        "exempt_tiers": sorted(table.exempt_tiers),
        "mode": policy.mode.value,
    }
    if share.enabled:
        document["fair_share"] = True
    if "weight" in carried and (share.users or share.tiers or share.teams):
        weights: dict[str, Any] = {
            "users": dict(share.users),
            "tiers": dict(share.tiers),
        }
        if share.teams:
            weights["teams"] = dict(share.teams)
        document["weights"] = weights
    teams = policy.team_table()
    if teams:
        document["team_rates"] = teams.rates
        document["team_members"] = teams.memberships
    if policy.bands:
        document[BANDS_KEY] = list(policy.bands)
    if policy.objectives:
        document[OBJECTIVES_KEY] = dict(policy.objectives)
    if beyond := attributes_of(policy, carried):
        document[ATTRIBUTES_KEY] = beyond
    return json.dumps(document, sort_keys=True, ensure_ascii=False)


def decode(document: str | bytes) -> Policy:
    """The policy a stored document holds, its mode and fair-share switch set
    (``ENFORCE`` and off where the document has none); ValueError
    (``PolicyError`` for the policy's rules, ``pacing.policy.document``) naming
    what is wrong: a missing or unknown field, or the piece and the path of a
    broken rule."""
    try:
        raw: Any = json.loads(document)
    except (ValueError, UnicodeDecodeError) as error:
        raise ValueError(f"limits document is not JSON: {error}") from None
    if not isinstance(raw, dict):
        raise ValueError("limits document must be a JSON object")
    missing = [name for name in _FIELDS if name not in raw]
    unknown = sorted(
        set(raw)
        - {*_FIELDS, *_POLICY_FIELDS, *_TEAM_FIELDS, *_BAND_FIELDS, ATTRIBUTES_KEY}
    )
    if missing or unknown:
        raise ValueError(
            f"limits document: missing fields {missing}, unknown fields {unknown}"
        )
    pieces = {
        name: value
        for name, value in raw.items()
        if name not in ("weights", ATTRIBUTES_KEY)
    }
    try:
        weights = check_object(raw.get("weights") or {}, "", ("weights",))
        check_keys(weights, tuple(WEIGHT_KEYS.values()), ("weights",))
        for holder, key in WEIGHT_KEYS.items():
            pieces[f"{holder}_weights"] = weights.get(key)
        tree = tree_of(pieces)
        if ATTRIBUTES_KEY in raw:
            tree = with_attributes(tree, raw[ATTRIBUTES_KEY])
        policy = parse(tree).policy
    except PolicyError as error:
        raise error.at("limits document") from None
    return dataclasses.replace(
        policy,
        mode=Mode.ENFORCE if policy.mode is None else policy.mode,
        fair_share=bool(policy.fair_share),
    )
