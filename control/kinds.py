"""The kinds of rate holder the control plane serves, each a collection of one
resource type over the policy (``pacing.policy.model``): user entries
(``limits/{user}``), and one collection per group kind (``tiers/{tier}``,
``teams/{team}``).

A kind's fields are the ``Limits`` attributes its holder may set
(``ATTRIBUTES``) followed by, for users, the group of each kind it is a member
of; they are its update-mask paths, its messages' fields and its CLI options,
so an attribute added to the policy is served by every verb at once. The verbs
(get, list, create, update, delete) are the same for every kind
(``control.service.holders``); what differs is said here: which fields make a
holder exist and which it cannot lack.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from control.errors import InvalidArgument
from control.table import check_user, shown
from pacing.policy.model import ATTRIBUTES, KINDS, GroupKind, Limits


@dataclass(frozen=True)
class Kind:
    """One collection of rate holders (see the module docstring)."""

    #: The policy's holder: ``user`` or a group kind.
    holder: str
    #: Resource names are ``{collection}/{id}``.
    collection: str
    #: The request field holding one resource (``limit``, ``tier``, ``team``).
    resource: str
    #: The resource's message and RPC suffix (``Limit``, ``Tier``, ``Team``).
    title: str
    #: Fields any of which makes a holder exist (None: any field).
    exists_with: tuple[str, ...] | None = None
    #: Attributes a holder cannot lack: required to create, never cleared.
    required: tuple[str, ...] = ()

    @property
    def attributes(self) -> tuple[str, ...]:
        """The ``Limits`` attributes this kind's holders may set."""
        return ATTRIBUTES[self.holder]

    @property
    def references(self) -> tuple[GroupKind, ...]:
        """The group kinds a holder of this kind may be a member of."""
        return KINDS if self.holder == "user" else ()

    @property
    def fields(self) -> tuple[str, ...]:
        """The mutable fields: attributes, then memberships."""
        return (*self.attributes, *self.references)

    @property
    def is_group(self) -> bool:
        return self.holder != "user"

    @property
    def makes_exist(self) -> tuple[str, ...]:
        return self.fields if self.exists_with is None else self.exists_with

    def name(self, holder_id: str) -> str:
        """``{collection}/{id}``."""
        return f"{self.collection}/{holder_id}"

    def id_of(self, name: str) -> str:
        """The id in a name the server sent (not checked again); ``""`` for
        ``""``."""
        return name.removeprefix(f"{self.collection}/")

    def parse(self, name: str, *, field: str) -> str:
        """The id of ``{collection}/{id}``; InvalidArgument naming ``field``
        when ``name`` has another form or the id is invalid."""
        prefix = f"{self.collection}/"
        if not name.startswith(prefix):
            raise InvalidArgument(
                f"{field} must look like {prefix}{{{self.holder}}}, got {shown(name)}"
            )
        return check_user(name[len(prefix) :], field=f"{self.holder} id in {field}")

    def wire(
        self, limits: Limits, groups: Mapping[GroupKind, str]
    ) -> dict[str, object]:
        """Each field as the API carries it: 0, false or "" for none, a
        membership as the group's resource name."""
        values = attributes_wire(limits, self.attributes)
        for kind in self.references:
            group = groups.get(kind)
            values[kind] = "" if group is None else BY_HOLDER[kind].name(group)
        return values

    def unwire(
        self, values: Mapping[str, object]
    ) -> tuple[Limits, dict[GroupKind, str]]:
        """The limits and memberships that wire ``values`` say, as the server
        sent them (not checked again)."""
        limits = attributes_unwire(values, self.attributes)
        groups = {
            kind: BY_HOLDER[kind].id_of(str(values[kind]))
            for kind in self.references
            if values.get(kind)
        }
        return limits, groups

    def check_id(self, holder_id: str, *, field: str) -> str:
        """``holder_id`` if it is a valid id (the user-id rule)."""
        return check_user(holder_id, field=field)


#: The ``Limits`` attributes that hold a name (a band), not a number or a
#: flag: the API carries them as strings, ``""`` for none.
TEXT_ATTRIBUTES: Final = tuple(
    item.name
    for item in dataclasses.fields(Limits)
    if "str" in str(item.type).replace(" ", "").split("|")
)


def attributes_wire(limits: Limits, attributes: tuple[str, ...]) -> dict[str, Any]:
    """``attributes`` of ``limits`` as the API carries them: 0 (``""`` for a
    name, ``TEXT_ATTRIBUTES``) for none."""
    return {
        name: _none_on_wire(name) if (value := getattr(limits, name)) is None else value
        for name in attributes
    }


def _none_on_wire(attribute: str) -> object:
    """What the API carries for ``attribute`` not set: ``""`` for a name, else
    0."""
    return "" if attribute in TEXT_ATTRIBUTES else 0


def attributes_unwire(
    values: Mapping[str, object], attributes: tuple[str, ...]
) -> Limits:
    """The limits that wire ``values`` of ``attributes`` say (0, false, "": none),
    as the server sent them (not checked again)."""
    given: dict[str, Any] = {
        name: values[name] for name in attributes if values.get(name)
    }
    return Limits(**given)


USERS: Final = Kind("user", "limits", "limit", "Limit")
TIERS: Final = Kind("tier", "tiers", "tier", "Tier", ("tokens_per_second", "exempt"))
TEAMS: Final = Kind(
    "team", "teams", "team", "Team", ("tokens_per_second",), ("tokens_per_second",)
)
#: Every kind, in the order tables list them.
ALL: Final[tuple[Kind, ...]] = (USERS, TIERS, TEAMS)
#: The kind of each holder (``user``, ``tier``, ``team``).
BY_HOLDER: Final[Mapping[str, Kind]] = {kind.holder: kind for kind in ALL}
