"""The real Redis store, counting what it handed out and took back: for tests
and benchmarks that check where every claimed token went."""

from __future__ import annotations

from collections.abc import Mapping

from pacing.claims import Request
from store.redis_store import Exchange, RedisStore


class CountingStore(RedisStore):
    """``RedisStore`` counting claims sent, tokens granted and tokens returned,
    and the Redis time (µs) of the first and the last grant of a token."""

    claims = 0
    granted = 0
    returned = 0
    first_grant_us: int | None = None
    last_grant_us: int | None = None

    def exchange(
        self,
        claims: Mapping[str, Request],
        returns: Mapping[str, Request],
        heartbeat: tuple[str, int] | None = None,
    ) -> Exchange:
        answer = super().exchange(claims, returns, heartbeat)
        self.claims += len(claims)
        self.returned += sum(request.tokens for request in returns.values())
        for grant in answer.grants.values():
            if grant.granted:
                self.granted += grant.granted
                at = grant.server_time_us
                if self.first_grant_us is None or at < self.first_grant_us:
                    self.first_grant_us = at
                if self.last_grant_us is None or at > self.last_grant_us:
                    self.last_grant_us = at
        return answer
