"""Priority bands: strict priority between bands, fair share inside each (pure:
no vLLM).

Vocabulary (llm-d / Gateway API Inference Extension flow control):

- *bands*: the policy's ordered list of band names, highest first
  (``bands: [interactive, standard, batch]``); index 0 is the highest.
- *a holder's band*: the ``band`` attribute of a user, its tier, its team or
  the default, resolved in that order (the default must name one once bands
  are set). A request may be put in another band by the trusted gateway's
  objective (``pacing.policy``: ``objectives`` maps an objective to a band).
- What the bands do in a step (order, preemption) is the scheduler's concern
  (``engine_ext.scheduling.bands``); this module holds the names and resolves
  each user's band.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pacing.identity import validate_user
from pacing.policy.errors import PathPart, PolicyError

#: Bands a policy may list.
MAX_BANDS = 8


def validate_band(value: object, *, field: str | Sequence[PathPart] = "band") -> str:
    """``value`` if it is a valid band name (the user-id rule), else
    ``PolicyError`` at ``field``."""
    try:
        return validate_user(value, field="band name")
    except ValueError as error:
        raise PolicyError(str(error), field) from None


@dataclass(frozen=True)
class BandTable:
    """The bands in force and each holder's band, as indices into ``names``
    (0: the highest). Without bands every user is in band 0 of one."""

    names: tuple[str, ...] = ()
    default: int = 0
    users: Mapping[str, int] = field(default_factory=dict)
    tiers: Mapping[str, int] = field(default_factory=dict)
    teams: Mapping[str, int] = field(default_factory=dict)
    #: objective name -> band index (the gateway's objective header).
    objectives: Mapping[str, int] = field(default_factory=dict)

    @property
    def active(self) -> bool:
        """Whether more than one band orders anything."""
        return len(self.names) > 1

    def index_of(self, user: str, tier: str | None, team: str | None) -> int:
        """``user``'s band: its own, its tier's, its team's, the default."""
        index = self.users.get(user)
        if index is not None:
            return index
        if tier is not None and (index := self.tiers.get(tier)) is not None:
            return index
        if team is not None and (index := self.teams.get(team)) is not None:
            return index
        return self.default

    def name_of(self, index: int) -> str:
        return self.names[index] if self.names else ""
