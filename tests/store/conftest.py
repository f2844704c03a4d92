"""The store's session-wide servers (tests/store_harness.py), registered by name
for the store's tests: one ``redis-server`` and one Redis Cluster for them all
(every test empties what it uses first). ``client`` stays registered per module:
the modules mean different fixtures by it (``client``, ``client_or_cluster``,
test_store_limits_sync's own)."""

from __future__ import annotations

from tests import store_harness

redis_url = store_harness.redis_url
local_cluster = store_harness.local_cluster
