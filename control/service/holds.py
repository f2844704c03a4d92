"""How much a read may do under one hold of ``shared.lock``, the lock the
scheduler holds for each step, and releasing it so a step can come in.

Invariant: each bound keeps a hold to about a millisecond at most, so a step
waits behind a read for no longer, whatever the number of users or teams.
"""

from __future__ import annotations

import time

#: Users whose sort key one hold reads (a key costs about 1 µs there) and
#: users whose state it reads (a state about 20 µs).
KEYS_PER_HOLD = 500
STATES_PER_HOLD = 50
#: Team members whose live requests and fair-share service one hold sums (two
#: lookups each, the cost of a sort key).
MEMBERS_PER_HOLD = KEYS_PER_HOLD


def let_a_step_in() -> None:
    """Gives the scheduler's thread, if it waits on the lock just released, the
    chance to take it: a released ``threading.Lock`` is not handed over, and
    this thread, holding the GIL, would otherwise take it again at once."""
    time.sleep(0)
