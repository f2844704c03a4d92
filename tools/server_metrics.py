"""Reads one sample off a server's Prometheus endpoint (``/metrics``)."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families


def metric_value(base_url: str, name: str, **labels: str) -> float | None:
    """The value of the first sample ``name`` with ``labels`` on ``/metrics``
    (None: no such sample)."""
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(
                sample.labels.get(k) == v for k, v in labels.items()
            ):
                return sample.value
    return None
