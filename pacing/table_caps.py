"""How big one limits table may be, wherever it comes from (the control
plane, the limits file, the store): checked by the policy's one validator
(``pacing.policy.document``) and by the control plane's writes."""

from __future__ import annotations

from typing import Final

#: Most users one table may name (with a limit, a tier, an exemption or a
#: weight): bounds memory, the size of one ``GetLimitsTable`` reply (about
#: 27 MB at 256-byte ids) and of the config file.
MAX_EXPLICIT_LIMITS: Final = 100_000
#: Most tiers: the metrics label series by tier, so the label set stays small.
MAX_TIERS: Final = 100
