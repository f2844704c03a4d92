"""vLLM's shared-storage ``ExampleConnector`` that also reports connector stats,
for the prefill/decode end-to-end test (``--kv-transfer-config`` with
``"kv_connector_module_path": "tools.kv_stats_connector"``).

The example connector reports no ``kv_connector_stats``, so with it alone the
field that carries our metrics payload to the API process
(``engine_ext.stats_payload``) would hold our payload only. This one counts,
on the scheduler side, the requests whose KV it was asked to load and their
tokens, and reports them as stats; vLLM's stat loggers read them back with
``build_kv_connector_stats`` (the log line) and ``build_prom_metrics``
(``LOADED_REQUESTS`` / ``LOADED_TOKENS`` on ``/metrics``). Both refuse a key
that is not theirs, so a payload of ours left in the field fails loudly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import Counter
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
    ExampleConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.utils import create_metric_per_engine

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

LOADED_REQUESTS = "vllm:stats_example_connector_loaded_requests"
LOADED_TOKENS = "vllm:stats_example_connector_loaded_tokens"
#: The only keys this connector's stats carry.
STATS_KEYS = frozenset({"requests", "tokens"})


def _checked(data: dict[str, Any]) -> dict[str, int]:
    """``data`` if it holds exactly this connector's keys, else raises."""
    if set(data) != STATS_KEYS:
        raise ValueError(
            f"kv_connector_stats holds keys {sorted(data)}, "
            f"not only {sorted(STATS_KEYS)}"
        )
    return data


@dataclass
class LoadStats(KVConnectorStats):
    """Requests whose KV was loaded from the shared storage, and their tokens."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {"requests": 0, "tokens": 0}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key in STATS_KEYS:
            self.data[key] += other.data[key]
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return self.data["requests"] == 0


class _LoadPromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        counter = self._counter_cls
        self._counters: dict[str, dict[int, Counter]] = {
            key: create_metric_per_engine(
                counter(name=name, documentation=documentation, labelnames=labelnames),
                per_engine_labelvalues,
            )
            for key, name, documentation in (
                ("requests", LOADED_REQUESTS, "Requests whose KV was loaded."),
                ("tokens", LOADED_TOKENS, "Tokens whose KV was loaded."),
            )
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        for key, value in _checked(transfer_stats_data).items():
            self._counters[key][engine_idx].inc(value)


class StatsExampleConnector(ExampleConnector):
    """``ExampleConnector`` reporting ``LoadStats`` from its scheduler side."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._loads = LoadStats()

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        # Called once a request's blocks are allocated: the tokens it loads.
        if num_external_tokens > 0:
            self._loads.data["requests"] += 1
            self._loads.data["tokens"] += num_external_tokens
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._loads.is_empty():
            return None
        stats, self._loads = self._loads, LoadStats()
        return stats

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats:
        return LoadStats(data=dict(_checked(data))) if data is not None else LoadStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return _LoadPromMetrics(
            vllm_config, metric_types, labelnames, per_engine_labelvalues
        )
