"""How ``output-rate-ctl`` spells a kind's commands and fields (``control.kinds``),
in one place for the parser (``control.cli.args``) and the commands' usage errors
(``control.cli.commands``): ``create-tier`` and ``teams create``; ``--rate`` for
``tokens_per_second``, ``--prompt-rate`` for ``prompt_tokens_per_second``,
``--ceiling`` for ``ceiling_tokens_per_second``, else the field's own name
(``--weight``, ``--tier``).
"""

from __future__ import annotations

from collections.abc import Sequence

from control.kinds import TEAMS, USERS, Kind
from pacing.policy.model import ATTRIBUTES

#: The attribute typed as a positional after the id (``create-tier ID RATE``,
#: as in ``set USER RATE``); every other attribute is an option.
POSITIONAL = "tokens_per_second"
#: Fields whose option and noun are not their own name.
_NAMES = {
    "tokens_per_second": "rate",
    "prompt_tokens_per_second": "prompt_rate",
    "ceiling_tokens_per_second": "ceiling",
}
#: Fields whose noun in a sentence is not their name.
_NOUNS = {
    "tokens_per_second": "rate",
    "exempt": "exemption",
    "prompt_tokens_per_second": "prompt rate",
    "ceiling_tokens_per_second": "ceiling",
}


def command(kind: Kind, verb: str) -> str:
    """The command running ``verb`` on ``kind``: user entries' commands are bare
    (``list``), teams' are under ``teams`` (``teams list``), tiers' are named
    for the tier (``list-tiers``, ``get-tier``)."""
    if kind is USERS:
        return verb
    if kind is TEAMS:
        return f"{kind.collection} {verb}"
    return f"{verb}-{kind.collection if verb == 'list' else kind.holder}"


def name(field: str) -> str:
    """``rate`` for ``tokens_per_second``, ``prompt-rate`` for
    ``prompt_tokens_per_second``, ``ceiling`` for ``ceiling_tokens_per_second``,
    else the field (``-`` for ``_``)."""
    return _NAMES.get(field, field).replace("_", "-")


def option(field: str) -> str:
    return f"--{name(field)}"


def clear_option(field: str) -> str:
    """The option that removes ``field`` (``--no-rate``)."""
    return f"--no-{name(field)}"


def noun(field: str) -> str:
    return _NOUNS.get(field, field.replace("_", " "))


def clearable(kind: Kind, field: str) -> bool:
    """Whether an update may remove ``field`` (one the holder cannot lack
    cannot be)."""
    return field not in kind.required


def clearable_default(field: str) -> bool:
    """Whether ``update-default`` may remove the default's ``field`` (not its
    rate: pacing stays on)."""
    return field != POSITIONAL


def default_update_options() -> list[str]:
    """The options of ``update-default``, in order: each attribute's, then its
    clear."""
    options = []
    for field in ATTRIBUTES["default"]:
        options.append(option(field))
        if clearable_default(field):
            options.append(clear_option(field))
    return options


def update_options(kind: Kind) -> list[str]:
    """The options of an update, in order: each field's (attributes, then
    memberships), then its clear."""
    options = []
    for field in kind.fields:
        options.append(option(field))
        if clearable(kind, field):
            options.append(clear_option(field))
    return options


def creates_with(kind: Kind) -> str:
    """What a create needs, one of the fields that make a holder exist:
    ``a RATE, --exempt or both`` (``a RATE``: the positional)."""
    words = [
        f"a {name(field).upper()}" if field == POSITIONAL else option(field)
        for field in kind.makes_exist
    ]
    if len(words) > 1:
        words.append("both" if len(words) == 2 else "several")
    return either(words)


def either(words: Sequence[str]) -> str:
    """``a, b or c``."""
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def neither(words: Sequence[str]) -> str:
    """``neither a nor b`` (``no a`` for one)."""
    return f"no {words[0]}" if len(words) == 1 else f"neither {' nor '.join(words)}"
