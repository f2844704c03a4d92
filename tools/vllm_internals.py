"""Every vLLM internal per-user pacing relies on, with what vLLM 0.32.0 has.

The one list ``tools.vllm_drift`` checks another vLLM source against: the rows
of the "Hooks into vLLM" table (docs/development.md), the Scheduler members
and ``Request`` fields ``engine_ext/scheduling/upstream.py`` reaches, the methods
``engine_ext/scheduler.py`` overrides, those ``engine_ext/hooks.py`` wraps, and
the config fields ``engine_ext/supported.py`` reads. Each row states the form
0.32.0 has (a method's signature, an attribute's kind) and, where a hook depends
on how upstream uses the internal, where 0.32.0 uses it (``Uses``).
``tests/scheduling/test_vllm_drift.py`` checks this list against the installed
vLLM 0.32.0 and against what our code names.
"""

from __future__ import annotations

from dataclasses import dataclass

#: The vLLM release the ``expected`` forms and places below are taken from.
REFERENCE_VERSION = "0.32.0"


@dataclass(frozen=True)
class Region:
    """A loop of an upstream method, told apart by a name it mentions: in its
    header (a ``while`` test, a ``for`` iterable) or directly in its body
    (nested loops and functions excluded). ``mentions=None`` matches any loop."""

    name: str
    where: str = "body"  # "header" or "body"
    mentions: str | None = None


@dataclass(frozen=True)
class Uses:
    """Where upstream reads, writes or calls an internal: every occurrence of
    ``RECEIVER.name`` in the methods of ``owner`` (one ``method`` or all),
    each labelled ``method`` or ``method: loop`` (loops per ``REGIONS``)."""

    module: str
    owner: str
    access: str  # "call", "read" or "write"
    expected: tuple[str, ...]
    method: str | None = None
    receiver: str | None = "self"  # None: any receiver
    #: Labels also name the statement each occurrence sits in ("if → break").
    statement: bool = False


@dataclass(frozen=True)
class Internal:
    """One internal: ``owner.name`` in ``module`` (a dotted import path, followed
    through re-exports), of ``kind`` "class", "method" or "attribute".

    ``expected``: a class's bases, a method's signature (decorators, parameter
    names, kinds and defaults, wherever in its bases vLLM defines it)
    or an attribute's form ("instance attribute", "class attribute",
    "property", "method"). ``direct``: must be defined on ``owner`` itself
    (``engine_ext.hooks`` replaces it in the class ``__dict__``)."""

    module: str
    owner: str
    name: str
    kind: str
    expected: str
    by: str
    direct: bool = False
    uses: Uses | None = None

    @property
    def label(self) -> str:
        return self.owner if self.kind == "class" else f"{self.owner}.{self.name}"


SCHED = "vllm.v1.core.sched.scheduler"
CORE = "vllm.v1.engine.core"

#: Loops of the methods ``Uses`` looks into, first match wins.
REGIONS: dict[str, tuple[Region, ...]] = {
    "Scheduler.schedule": (
        Region("running loop", "header", "self.running"),
        Region("preemption loop", "body", "self._preempt_request"),
        Region("waiting loop", "body", "self.kv_holding_waiting"),
    ),
    "EngineCoreProc.run_busy_loop": (
        Region("busy loop", "body", "self._process_input_queue"),
    ),
    "EngineCoreProc._process_input_queue": (Region("loop"),),
}


def _sched(
    name: str, kind: str, expected: str, by: str, uses: Uses | None = None
) -> Internal:
    return Internal(SCHED, "Scheduler", name, kind, expected, by, uses=uses)


def _in_schedule(access: str, *expected: str) -> Uses:
    return Uses(SCHED, "Scheduler", access, expected, method="schedule")


def _fields(
    module: str, owner: str, by: str, forms: dict[str, str]
) -> tuple[Internal, ...]:
    return tuple(
        Internal(module, owner, name, "attribute", form, by)
        for name, form in forms.items()
    )


INSTANCE = "instance attribute"
FIELD = "class attribute"
PROPERTY = "property"
SCHEDULER_PY = "engine_ext/scheduler.py"
UPSTREAM_PY = "engine_ext/scheduling/upstream.py"
HOOKS_PY = "engine_ext/hooks.py"
SUPPORTED_PY = "engine_ext/supported.py"

SCHEDULER: tuple[Internal, ...] = (
    _sched("Scheduler", "class", "SchedulerInterface", SCHEDULER_PY),
    Internal(
        "vllm.v1.core.sched.async_scheduler",
        "AsyncScheduler",
        "AsyncScheduler",
        "class",
        "Scheduler",
        SCHEDULER_PY,
    ),
    _sched(
        "__init__",
        "method",
        "(self, vllm_config, kv_cache_config, structured_output_manager, "
        "block_size, hash_block_size=None, mm_registry=MULTIMODAL_REGISTRY, "
        "include_finished_set=False, log_stats=False)",
        SCHEDULER_PY,
    ),
    _sched(
        "schedule",
        "method",
        "(self, throttle_prefills=False)",
        SCHEDULER_PY,
    ),
    _sched(
        "_reserve_prefill_lookahead",
        "method",
        "(self, request, num_computed_tokens, num_new_tokens)",
        SCHEDULER_PY,
        _in_schedule("call", "schedule: running loop", "schedule: waiting loop"),
    ),
    _sched(
        "_handle_blocked_waiting_request",
        "method",
        "(self, request)",
        SCHEDULER_PY,
        _in_schedule("call", "schedule: waiting loop"),
    ),
    _sched(
        "_preempt_request",
        "method",
        "(self, request, timestamp, drop_stale_output=False)",
        SCHEDULER_PY,
        _in_schedule("call", "schedule: running loop > preemption loop"),
    ),
    _sched(
        "_try_schedule_encoder_inputs",
        "method",
        "(self, request, num_computed_tokens, num_new_tokens, "
        "encoder_compute_budget, shift_computed_tokens=0)",
        SCHEDULER_PY,
        _in_schedule("call", "schedule: running loop", "schedule: waiting loop"),
    ),
    _sched("add_request", "method", "(self, request)", SCHEDULER_PY),
    _sched(
        "update_from_output",
        "method",
        "(self, scheduler_output, model_runner_output)",
        SCHEDULER_PY,
    ),
    _sched(
        "_free_request",
        "method",
        "(self, request, delay_free_blocks=False)",
        SCHEDULER_PY,
    ),
    _sched(
        "make_stats",
        "method",
        "(self, spec_decoding_stats=None, kv_connector_stats=None, "
        "cudagraph_stats=None, perf_stats=None, ec_connector_stats=None)",
        SCHEDULER_PY,
    ),
    _sched("shutdown", "method", "(self)", SCHEDULER_PY),
    _sched(
        "get_request_counts",
        "method",
        "(self)",
        "docs/development.md (hidden parked requests)",
        _in_schedule("call", "schedule", "schedule"),
    ),
    _sched(
        "_update_after_schedule",
        "method",
        "(self, scheduler_output)",
        "docs/development.md (Request.is_prefill_chunk)",
        _in_schedule("call", "schedule"),
    ),
    _sched("_request_blocks_can_be_freed", "method", "(self, request)", UPSTREAM_PY),
    _sched(
        "_mamba_block_aligned_split",
        "method",
        "(self, request, num_new_tokens, num_new_local_computed_tokens=0, "
        "num_external_computed_tokens=0)",
        UPSTREAM_PY,
    ),
    _sched("_get_local_prefix_cache_hit", "method", "(self, request)", UPSTREAM_PY),
    _sched(
        "running",
        "attribute",
        INSTANCE,
        UPSTREAM_PY,
        _in_schedule(
            "read",
            "schedule",
            "schedule",
            "schedule",
            "schedule: running loop",
            "schedule: running loop",
            "schedule: running loop > preemption loop",
            "schedule: running loop > preemption loop",
            "schedule: running loop > preemption loop",
            "schedule: running loop > preemption loop",
            "schedule: running loop > preemption loop",
            "schedule: waiting loop",
            "schedule: waiting loop",
            "schedule: waiting loop",
        ),
    ),
    _sched(
        "max_num_active_reqs",
        "attribute",
        INSTANCE,
        UPSTREAM_PY,
        Uses(
            SCHED,
            "Scheduler",
            "read",
            ("schedule: waiting loop (if → break)",),
            statement=True,
        ),
    ),
    *(
        _sched(name, "attribute", INSTANCE, UPSTREAM_PY)
        for name in (
            "vllm_config",
            "kv_cache_config",
            "scheduler_config",
            "cache_config",
            "waiting",
            "kv_holding_waiting",
            "num_waiting_for_streaming_input",
            "requests",
            "max_num_running_reqs",
            "max_num_scheduled_tokens",
            "num_lookahead_tokens",
            "block_size",
            "policy",
            "kv_cache_manager",
            "log_stats",
            "num_spec_tokens",
            "need_mamba_block_aligned_split",
            "num_prefill_lookahead",
            "connector",
            "lora_config",
        )
    ),
    Internal(
        "vllm.v1.core.kv_cache_manager",
        "KVCacheManager",
        "block_pool",
        "attribute",
        INSTANCE,
        UPSTREAM_PY,
    ),
    Internal(
        "vllm.v1.core.block_pool",
        "BlockPool",
        "get_num_free_blocks",
        "method",
        "(self)",
        UPSTREAM_PY,
    ),
    Internal(
        "vllm.v1.core.sched.output",
        "SchedulerOutput",
        "num_scheduled_tokens",
        "attribute",
        FIELD,
        "engine_ext/scheduling/steps.py",
    ),
    Internal(
        "vllm.v1.core.sched.output",
        "SchedulerOutput",
        "scheduled_spec_decode_tokens",
        "attribute",
        FIELD,
        "engine_ext/scheduling/steps.py",
    ),
    Internal(
        "vllm.v1.core.sched.request_queue",
        "SchedulingPolicy",
        "PRIORITY",
        "attribute",
        FIELD,
        UPSTREAM_PY,
    ),
    *(
        Internal(
            "vllm.v1.core.sched.request_queue",
            "RequestQueue",
            name,
            "method",
            signature,
            UPSTREAM_PY,
        )
        for name, signature in (
            ("add_request", "@abstractmethod (self, request)"),
            ("remove_requests", "@abstractmethod (self, requests)"),
        )
    ),
)

REQUEST: tuple[Internal, ...] = (
    *_fields(
        "vllm.v1.request",
        "Request",
        UPSTREAM_PY,
        {
            "request_id": INSTANCE,
            "status": INSTANCE,
            "priority": INSTANCE,
            "arrival_time": INSTANCE,
            "num_tokens": PROPERTY,
            "num_prompt_tokens": INSTANCE,
            "num_computed_tokens": INSTANCE,
            "num_output_placeholders": INSTANCE,
            "num_output_tokens": PROPERTY,
            "sampling_params": INSTANCE,
            "trace_headers": INSTANCE,
        },
    ),
    Internal(
        "vllm.v1.request",
        "Request",
        "is_prefill_chunk",
        "attribute",
        INSTANCE,
        UPSTREAM_PY,
        uses=Uses(
            SCHED,
            "Scheduler",
            "write",
            ("_update_after_schedule",),
            receiver=None,
        ),
    ),
    *_fields(
        "vllm.v1.request",
        "RequestStatus",
        UPSTREAM_PY,
        dict.fromkeys(
            (
                "RUNNING",
                "WAITING",
                "PREEMPTED",
                "WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR",
                "WAITING_FOR_REMOTE_KVS",
            ),
            FIELD,
        ),
    ),
    *_fields(
        "vllm.sampling_params", "SamplingParams", SCHEDULER_PY, {"extra_args": FIELD}
    ),
)

KV_AND_STATS: tuple[Internal, ...] = (
    *_fields(
        "vllm.v1.kv_cache_interface",
        "KVCacheConfig",
        UPSTREAM_PY,
        {"kv_cache_groups": FIELD},
    ),
    *_fields(
        "vllm.v1.kv_cache_interface",
        "KVCacheGroupSpec",
        UPSTREAM_PY,
        {"kv_cache_spec": FIELD},
    ),
    *_fields(
        "vllm.v1.kv_cache_interface",
        "FullAttentionSpec",
        UPSTREAM_PY,
        {"block_size": FIELD},
    ),
    *_fields(
        "vllm.v1.metrics.stats",
        "SchedulerStats",
        "engine_ext/payload_builder.py",
        {"kv_connector_stats": FIELD},
    ),
)

CONFIG: tuple[Internal, ...] = (
    *_fields(
        "vllm.config",
        "VllmConfig",
        SUPPORTED_PY,
        dict.fromkeys(
            (
                "additional_config",
                "model_config",
                "cache_config",
                "parallel_config",
                "scheduler_config",
                "observability_config",
                "speculative_config",
                "diffusion_config",
                "kv_transfer_config",
                "ec_transfer_config",
                "aux_output_config",
            ),
            FIELD,
        ),
    ),
    *_fields(
        "vllm.config",
        "SchedulerConfig",
        SUPPORTED_PY,
        dict.fromkeys(
            (
                "scheduler_cls",
                "async_scheduling",
                "enable_chunked_prefill",
                "long_prefill_token_threshold",
            ),
            FIELD,
        ),
    ),
    *_fields(
        "vllm.config",
        "CacheConfig",
        SUPPORTED_PY,
        {"enable_prefix_caching": FIELD, "kv_offloading_size": FIELD},
    ),
    *_fields(
        "vllm.config",
        "ParallelConfig",
        SUPPORTED_PY,
        dict.fromkeys(
            ("data_parallel_index", "data_parallel_size", "pipeline_parallel_size"),
            FIELD,
        ),
    ),
    *_fields(
        "vllm.config",
        "ObservabilityConfig",
        SCHEDULER_PY,
        {"otlp_traces_endpoint": FIELD},
    ),
    *_fields(
        "vllm.config",
        "ModelConfig",
        SUPPORTED_PY,
        dict.fromkeys(
            (
                "is_multimodal_model",
                "is_encoder_decoder",
                "is_hybrid",
                "is_attention_free",
                "is_diffusion",
            ),
            PROPERTY,
        ),
    ),
    *_fields("vllm.config", "AuxOutputConfig", SUPPORTED_PY, {"enabled": PROPERTY}),
)

ENGINE: tuple[Internal, ...] = (
    Internal(
        "vllm.engine.arg_utils",
        "EngineArgs",
        "add_cli_args",
        "method",
        "@staticmethod (parser)",
        HOOKS_PY,
        direct=True,
    ),
    Internal(
        "vllm.engine.arg_utils",
        "EngineArgs",
        "from_cli_args",
        "method",
        "@classmethod (cls, args)",
        HOOKS_PY,
        direct=True,
    ),
    Internal(
        "vllm.engine.arg_utils",
        "EngineArgs",
        "create_engine_config",
        "method",
        "(self, usage_context=None, headless=False)",
        HOOKS_PY,
        direct=True,
    ),
    *_fields(
        "vllm.engine.arg_utils", "EngineArgs", HOOKS_PY, {"additional_config": FIELD}
    ),
    Internal(
        CORE,
        "EngineCoreProc",
        "_process_engine_step",
        "method",
        "(self)",
        HOOKS_PY,
        direct=True,
        uses=Uses(CORE, "EngineCoreProc", "call", ("run_busy_loop: busy loop",)),
    ),
    Internal(
        CORE,
        "EngineCoreProc",
        "run_busy_loop",
        "method",
        "@fault_tolerant_wrapper (self)",
        HOOKS_PY,
        direct=True,
    ),
    Internal(
        CORE,
        "EngineCoreProc",
        "_handle_client_request",
        "method",
        "(self, request_type, request)",
        HOOKS_PY,
        direct=True,
        uses=Uses(
            CORE,
            "EngineCoreProc",
            "call",
            ("_process_input_queue: loop", "_process_input_queue: loop"),
        ),
    ),
    *_fields(
        CORE,
        "EngineCoreProc",
        HOOKS_PY,
        {"input_queue": INSTANCE, "output_queue": INSTANCE, "scheduler": INSTANCE},
    ),
    Internal(
        "vllm.v1.engine",
        "EngineCoreRequestType",
        "WAKEUP",
        "attribute",
        FIELD,
        HOOKS_PY,
        uses=Uses(
            CORE,
            "EngineCoreProc",
            "read",
            ("_handle_client_request", "run_engine_core: def wakeup_engine"),
            receiver="EngineCoreRequestType",
        ),
    ),
    *_fields(
        "vllm.v1.engine",
        "EngineCoreOutputs",
        "engine_ext/idle_stats.py",
        {"scheduler_stats": FIELD},
    ),
    *_fields("vllm.v1.engine", "EngineCoreOutput", HOOKS_PY, {"trace_headers": FIELD}),
    Internal(
        "vllm.v1.engine.output_processor",
        "OutputProcessor",
        "do_tracing",
        "method",
        "(self, engine_core_output, req_state, iteration_stats)",
        HOOKS_PY,
        direct=True,
    ),
)

#: The list ``tools.vllm_drift`` checks.
INTERNALS: tuple[Internal, ...] = SCHEDULER + REQUEST + KV_AND_STATS + CONFIG + ENGINE
