"""The global budget in Redis: one GCRA cell per user shared by every engine
(``store.cell``), the Redis client side (``store.redis_store``) and the claimer
thread that keeps an engine's local balances (``pacing.claims``) filled without
the scheduling step ever waiting on the network (``store.claimer``)."""
