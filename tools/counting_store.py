"""The real Redis store, counting what it handed out and took back: for tests
and benchmarks that check where every claimed token went."""

from __future__ import annotations

from collections.abc import Mapping

from pacing.claims import Request
from store.redis_store import Exchange, RedisStore


class CountingStore(RedisStore):
    """``RedisStore`` counting claims sent, tokens granted and tokens returned."""

    claims = 0
    granted = 0
    returned = 0

    def exchange(
        self,
        claims: Mapping[str, Request],
        returns: Mapping[str, Request],
        heartbeat: tuple[str, int] | None = None,
    ) -> Exchange:
        answer = super().exchange(claims, returns, heartbeat)
        self.claims += len(claims)
        self.granted += sum(grant.granted for grant in answer.grants.values())
        self.returned += sum(request.tokens for request in returns.values())
        return answer
