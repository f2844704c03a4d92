"""Helpers for the metrics payload's tests (``tests/scheduling/test_payload_*.py``): a
payload built the way the scheduler builds it, after the JSON round trip a
msgpack trip resembles."""

from __future__ import annotations

import json

from engine_ext.payload_builder import PayloadBuilder
from pacing.accounting import Accounting

MS = 1_000_000


def build(builder: PayloadBuilder, accounting: Accounting, rates: dict, **kw):
    """One payload, after the JSON round trip a msgpack trip resembles."""
    args = {
        "default_rate": 10,
        "throttled_requests": 0,
        "tracked_users": 0,
        **kw,
    }
    raw = builder.build(accounting=accounting, user_rates=rates, **args)
    return json.loads(json.dumps(raw))
