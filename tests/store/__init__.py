"""Tests of the global store (``store/``): the Redis side, the claimer, the
limits table's sync, TLS and the store's settings."""
