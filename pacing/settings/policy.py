"""The start-up policy: ``--output-rate-policy``'s document, or the same
document built from its aliases (the flags of ``POLICY_ALIASES``, and the
older keys of ``additional_config`` of the same names: ``pacing.policy.flat``),
checked by the one validator (``pacing.policy.document``).

An error of a piece given by an alias names the alias flag and the path of the
document it built (``--output-rate-tier-members: memberships.u7: unknown tier
'gold'``): the words are the limits file's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pacing.policy.document import ETAG_KEY, STORE_VERSION_KEY, Document, parse
from pacing.policy.errors import PolicyError
from pacing.policy.flat import piece_of, tree_of
from pacing.policy.model import Policy
from pacing.policy.text import load_inline_or_file
from pacing.settings.checks import SettingsError
from pacing.settings.flags import POLICY_ALIASES, POLICY_FLAG


def policy_of_pieces(pieces: Mapping[str, Any], *, source: str | None = None) -> Policy:
    """The policy of ``pieces``; ``SettingsError`` said of ``source`` or, without
    one, of the alias flag that gave the faulty piece."""
    try:
        return parse(tree_of(pieces)).policy
    except PolicyError as error:
        where = source or POLICY_ALIASES.get(piece_of(error, pieces), POLICY_FLAG)
        raise SettingsError(str(error.at(where))) from None


def policy_of_flag(value: str) -> Policy:
    """``POLICY_FLAG``'s policy: a JSON document, or the path of a JSON or YAML
    file (read once, at start: the limits file is the one that is watched)."""
    try:
        return start_policy(load_inline_or_file(value, source=POLICY_FLAG))
    except PolicyError as error:
        raise SettingsError(str(error)) from None


def policy_of_entry(tree: object, *, source: str) -> Policy:
    """The policy of a whole document in ``additional_config``."""
    try:
        return start_policy(parse(tree, source=source))
    except PolicyError as error:
        raise SettingsError(str(error)) from None


def start_policy(document: Document) -> Policy:
    """``document``'s policy; a start-up policy holds no etag or store version
    (the limits file's and the store's own)."""
    for key, value in (
        (ETAG_KEY, document.etag),
        (STORE_VERSION_KEY, document.store_version),
    ):
        if value is not None:
            raise PolicyError(
                "a start-up policy holds none (it belongs to exports and the "
                "limits file)",
                (key,),
                source=POLICY_FLAG,
            )
    return document.policy
