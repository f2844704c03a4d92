"""The global GCRA cell: one per user in Redis, changed only by two atomic Lua
scripts (``CLAIM``, ``RETURN``) that read the time from Redis (``TIME``), so every
engine's claims are judged on one clock.

State: a hash under one key per user (``KeySpace.cell``, the user in a hash tag
so that all of one user's keys share a Redis Cluster slot) with

- ``debt``: how far the theoretical arrival time (TAT) runs ahead of the instant
  ``s``.``us`` (Redis time: seconds, microseconds), in *micro-tokens*: millionths
  of an emission interval. In these units the debt does not depend on the rate,
  so a rate change keeps it, exactly as the single-engine limiter keeps a user's
  token debt (``OutputRateLimiter.set_rate``);
- ``rate``: the tokens/s it decays at (``rate`` micro-tokens per microsecond),
  the rate of the last call: a call with another rate first decays the debt at
  the stored one up to now, then carries it on at the new one.

A cell whose debt has decayed to 0 is the same as no cell (a full bucket), so
every write sets the key to expire when that happens. The rate comes with every
call from the engine (which resolves it from the limits table), because a script
may touch only the keys it declares, and on Cluster the table is in another slot.

GCRA, in debt terms: with tolerance ``tau`` (in micro-tokens, ``tolerance_us *
rate``), the k-th of n tokens claimed at once is granted iff ``debt + (k - 1) *
10**6 <= tau``, so a claim gets ``min(n, (tau - debt) // 10**6 + 1)`` (0 when
``debt > tau``) and adds ``10**6`` per token. A return of k tokens subtracts
``k * 10**6``, never below 0 (a return cannot create budget never earned).
Numbers in Redis Lua are doubles: everything the scripts compute is an integer
below 2**53 (a debt is at most ``tau`` plus one burst, about 2 * 10**11 at
``MAX_RATE`` and 100 ms), except ``elapsed * rate`` after a long idle time,
which is then only compared with the debt and clamped to 0.

Over-grant bound. Let R be the rate (one rate through the window), tau the
tolerance in seconds, times on Redis' clock, D(t) the debt in tokens at t,
O(t) the tokens claimed but neither spent nor returned at t (in
engines' balances, waiting to be returned, or granted and still on the way),
and, over a window (a, b] of W = b - a seconds, E the tokens emitted, G the
tokens granted and Ret the tokens returned.

1. A token emitted in (a, b] was outstanding at a or granted in (a, b], so
   ``E = O(a) - O(b) + G - Ret <= O(a) + G - Ret``.
2. D moves only thus: a grant of k adds k; a return of k takes off at most k
   (clamped at 0); time takes off at most R per second (clamped at 0). So
   ``D(b) >= D(a) + G - Ret - W*R``.
3. A token is granted only while D <= tau*R before it, so D <= tau*R + 1 right
   after a grant, and D only falls between grants: ``D(b) <= tau*R + 1``.

From 2 and 3, ``G - Ret <= (W + tau)*R + 1 - D(a)``, and with 1::

    E <= (W + tau)*R + 1 + (O(a) - D(a))

The store's tolerance is the single-engine burst, tau = 100 ms
(``DEFAULT_BURST_NS``), so the global bound is the single-engine GCRA bound
``(W + 0.1)*R + 1`` plus the outstanding tokens that the cell's debt no longer
counts, ``O(a) - D(a)``; as D >= 0, that implies the issue's form
``(W + 0.1)*R + 1 + O(a)``. The extra term is 0, and the bound exactly the
single-engine one, whenever the engines together hold no more than the cell's
debt. That is the steady state of a user paced at its limit: every grant brings
its debt back to about tau*R (100 ms of tokens), while the engines hold about one
claim horizon (50 ms) of its consumption between them, and at least a token each
while they hold any (so tau*R must be well above the number of engines; at 10
tok/s, tau*R is one token). The term is positive for tokens held longer than the
debt remembers them (claimed while the user was slow, then left unspent), and
bounded by what the engines hold: an engine claims again only when down to half
a claim, a claim is at most a burst (tau*R + 1), and unspent tokens go back to
the cell when their lease ends (1 s after they landed) or the user's last
request on the engine does.

A Redis failover that loses the last ``lag`` seconds of writes forgets the grants
of those seconds, at most ``(lag + tau)*R + 1`` tokens by the same argument: each
such failover can add that much, once, to the bound.
"""

from __future__ import annotations

from typing import Final

#: Micro-tokens per token: the unit of ``debt``.
MICRO: Final = 1_000_000

# Shared by both scripts: the time, the cell's debt decayed to now at its stored
# rate (``debt``, ``stored_rate``: nil for no cell), and ``save()``, which writes
# the debt at ``rate`` with an expiry a millisecond after it is paid off (or
# deletes a debt-free cell). The expiry is absolute, from TIME, and the cell is
# read before TIME: a cell must never expire while TIME says it still has debt,
# and relative expiries count from the server's command time, which can be
# earlier than TIME (fakeredis: by milliseconds under load). Integers are
# formatted with %.0f: a number passed to redis.call as is would be formatted
# with %.14g and lose digits.
_PROLOGUE = """
local function int(x) return string.format('%.0f', x) end
local cell = redis.call('HMGET', KEYS[1], 'debt', 'rate', 's', 'us')
local time = redis.call('TIME')
local now_s, now_us = tonumber(time[1]), tonumber(time[2])
local debt, stored_rate = 0, nil
if cell[1] then
  debt, stored_rate = tonumber(cell[1]), tonumber(cell[2])
  local elapsed = (now_s - tonumber(cell[3])) * 1000000 + now_us - tonumber(cell[4])
  if elapsed > 0 then  -- a clock that stepped back pays nothing off
    debt = math.max(0, debt - elapsed * stored_rate)
  end
end
local function save()
  if debt > 0 then
    redis.call('HSET', KEYS[1], 'debt', int(debt), 'rate', int(rate),
               's', int(now_s), 'us', int(now_us))
    local now_ms = now_s * 1000 + math.floor(now_us / 1000)
    redis.call('PEXPIREAT', KEYS[1], int(now_ms + math.ceil(debt / rate / 1000) + 1))
  else
    redis.call('DEL', KEYS[1])
  end
end
"""

#: KEYS[1]: the user's cell. ARGV: tokens wanted (n >= 0), rate (tokens/s),
#: tolerance (microseconds). Grants what GCRA allows now, at most n, and returns
#: ``{granted, still available, debt after (micro-tokens), now s, now us}``.
#: n = 0 reads the cell (writing only to carry a changed rate).
CLAIM: Final = (
    """
local n, rate = tonumber(ARGV[1]), tonumber(ARGV[2])
local tau = tonumber(ARGV[3]) * rate
"""
    + _PROLOGUE
    + """
local available = 0
if debt <= tau then available = math.floor((tau - debt) / 1000000) + 1 end
local granted = math.min(n, available)
debt = debt + granted * 1000000
if granted > 0 or (stored_rate and stored_rate ~= rate) then save() end
return {granted, available - granted, debt, now_s, now_us}
"""
)

#: KEYS[1]: the user's cell. ARGV: tokens given back, rate (tokens/s). Takes
#: them off the debt (not below 0) and returns ``{debt after, now s, now us}``.
RETURN: Final = (
    """
local count, rate = tonumber(ARGV[1]), tonumber(ARGV[2])
"""
    + _PROLOGUE
    + """
debt = math.max(0, debt - count * 1000000)
save()
return {debt, now_s, now_us}
"""
)


def retry_after_ns(available: int, debt: int, rate: int, tolerance_us: int) -> int:
    """How long until the cell grants a token again, given what a claim left:
    0 while ``available`` > 0, else the time for ``debt`` (micro-tokens) to fall
    to the tolerance, rounded up to the microsecond."""
    if available > 0:
        return 0
    excess = debt - tolerance_us * rate
    return max(0, -(-excess // rate)) * 1000
