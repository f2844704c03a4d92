"""What per-user pacing relies on in vLLM's V1 scheduler (0.32), in one place.

Every attribute and method of vLLM's ``Scheduler`` that a concern module reads,
writes or calls is reached through ``Upstream``, under a name of ours; the fields
of ``Request`` they read are listed in ``REQUEST_FIELDS``. The concern modules of
``engine_ext.scheduling`` import nothing from vLLM (an import-linter contract),
so a new vLLM version means checking this module and the thin class
(``engine_ext.scheduler``), which overrides upstream's methods.

Requests hash by identity (vLLM's ``Request`` defines neither ``__eq__`` nor
``__hash__``), so the concern modules key dicts and sets by the request
itself: a lookup then reads no attribute of it.

Invariant: ``Upstream`` reads through to the scheduler for everything upstream
changes during its life (``running`` is replaced by ``update_from_output``) and
keeps only settings fixed at construction.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.request_queue import FCFSRequestQueue, SchedulingPolicy
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig
from vllm.v1.request import Request, RequestStatus

from engine_ext.scheduling.upstream_queue import BandedQueue

if TYPE_CHECKING:
    from vllm.v1.core.sched.scheduler import Scheduler

__all__ = [
    "ASYNC_READY",
    "REQUEST_FIELDS",
    "RUNNING",
    "STARTABLE",
    "STEP_HOOK_NAMES",
    "BandedQueue",
    "Request",
    "SchedulerOutput",
    "Upstream",
    "first_prefill_chunk",
    "full_attention_block_sizes",
    "next_step_samples",
    "refused_prefill_end",
]

#: ``Request`` fields the concern modules read (and ``arrival_time``, which the
#: PRIORITY victim bias writes for the length of a step).
REQUEST_FIELDS = (
    "request_id",
    "status",
    "priority",
    "arrival_time",
    "num_tokens",
    "num_prompt_tokens",
    "num_computed_tokens",
    "num_output_placeholders",
    "num_output_tokens",
    "is_prefill_chunk",
)

#: Upstream methods ``schedule()`` calls per request that paced steps hook.
STEP_HOOK_NAMES = ("_reserve_prefill_lookahead", "_handle_blocked_waiting_request")

RUNNING = RequestStatus.RUNNING
WAITING_FOR_REMOTE_KVS = RequestStatus.WAITING_FOR_REMOTE_KVS
#: Waiting states upstream can admit in this step (others wait for a grammar,
#: a KV transfer or streamed input).
STARTABLE = (RequestStatus.WAITING, RequestStatus.PREEMPTED)
#: Waiting states that end without input to the engine (see
#: ``Upstream.awaits_asynchronous_work``); streamed input arrives as input and
#: wakes it.
ASYNC_READY = (
    RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR,
    RequestStatus.WAITING_FOR_REMOTE_KVS,
)


class Upstream:
    """One vLLM scheduler as the concern modules see it.

    What is fixed for a scheduler's life is read once; what upstream changes
    (``running`` is replaced by ``update_from_output``) is read through on every
    access. ``schedule`` is upstream's own ``schedule()``; ``preempt`` goes
    through the scheduler's ``_preempt_request`` (ours, which then calls
    upstream's).
    """

    __slots__ = (
        "_scheduler",
        "block_size",
        "chunked_prefill",
        "draft_tokens",
        "long_prefill_threshold",
        "lookahead_tokens",
        "lora",
        "mamba_aligned",
        "max_active",
        "prefill_lookahead",
        "prefix_caching",
        "priority_policy",
        "schedule",
        "slots",
        "token_budget",
    )

    def __init__(
        self, scheduler: Scheduler, schedule: Callable[[bool], SchedulerOutput]
    ) -> None:
        self._scheduler = scheduler
        self.schedule = schedule
        #: ``--max-num-seqs``: requests that may hold a model-runner slot.
        self.slots: int = scheduler.max_num_running_reqs
        #: ``--max-num-active-seqs`` as configured (the per-step cap moves).
        self.max_active: int = scheduler.max_num_active_reqs
        self.token_budget: int = scheduler.max_num_scheduled_tokens
        self.lookahead_tokens: int = scheduler.num_lookahead_tokens
        #: Draft tokens a speculative step may verify per request (0: off).
        self.draft_tokens: int = scheduler.num_spec_tokens
        self.block_size: int = scheduler.block_size
        self.priority_policy = scheduler.policy == SchedulingPolicy.PRIORITY
        self.chunked_prefill = bool(scheduler.scheduler_config.enable_chunked_prefill)
        self.prefix_caching = bool(scheduler.cache_config.enable_prefix_caching)
        self.long_prefill_threshold = bool(
            scheduler.scheduler_config.long_prefill_token_threshold
        )
        #: Whether LoRA adapters are served (``--enable-lora``).
        self.lora = scheduler.lora_config is not None
        #: Whether prefill chunks of a hybrid model must end on a Mamba block
        #: boundary (Mamba cache mode ``align``: state is written at chunk ends).
        self.mamba_aligned = bool(scheduler.need_mamba_block_aligned_split)
        #: Prefill positions a multi-token-prediction drafter reads ahead: a
        #: chunk must not end closer than that to the prefill's end (1: none).
        self.prefill_lookahead: int = scheduler.num_prefill_lookahead

    @property
    def running(self) -> list[Request]:
        """Requests holding a slot; upstream's running loop walks them in order."""
        return self._scheduler.running

    @property
    def waiting(self) -> Iterable[Request]:
        """The waiting queue, in admission order (sized, truthy when non-empty)."""
        return self._scheduler.waiting

    def anything_waits(self) -> bool:
        """Whether a request waits, to start or for its KV cache to be held."""
        scheduler = self._scheduler
        return bool(scheduler.waiting) or bool(scheduler.kv_holding_waiting)

    def reorder_waiting(self, order: list[Request]) -> None:
        """Puts the waiting queue in ``order`` (every request of the queue,
        once; a banded queue: within each band). An FCFS queue is a deque,
        refilled at once; any other goes through the queue's own methods."""
        queue = self._scheduler.waiting
        if isinstance(queue, BandedQueue):
            queue.refill(order)
            return
        if isinstance(queue, FCFSRequestQueue):
            deque.clear(queue)
            deque.extend(queue, order)
            return
        queue.remove_requests(order)
        queue.prepend_requests(reversed(order))  # prepends each: in order

    @property
    def banded_waiting(self) -> BandedQueue | None:
        """The waiting queue while it is banded (``band_waiting``)."""
        queue = self._scheduler.waiting
        return queue if isinstance(queue, BandedQueue) else None

    def band_waiting(self, band_of: Callable[[Request], int]) -> BandedQueue:
        """Replaces the FCFS waiting queue with a banded one holding its
        requests, by ``band_of`` (stably)."""
        scheduler = self._scheduler
        queue = BandedQueue(band_of)
        for request in scheduler.waiting:
            queue.add_request(request)
        queue.place_arrivals()
        scheduler.waiting = queue
        return queue

    def unband_waiting(self) -> None:
        """Puts back an FCFS waiting queue, in the banded queue's order."""
        scheduler = self._scheduler
        scheduler.waiting = FCFSRequestQueue(scheduler.waiting)

    def waiting_count(self) -> int:
        return len(self._scheduler.waiting)

    def held_slots(self) -> int:
        """Slots taken: running requests and those streaming input."""
        scheduler = self._scheduler
        return len(scheduler.running) + scheduler.num_waiting_for_streaming_input

    @staticmethod
    def started_ids(output: SchedulerOutput) -> list[str]:
        """The requests ``output``'s step scheduled from the waiting queue: new
        ones and those resumed after a preemption."""
        started = [data.req_id for data in output.scheduled_new_reqs]
        resumed = output.scheduled_cached_reqs.resumed_req_ids
        if resumed:
            started.extend(resumed)
        return started

    def requests(self) -> dict[str, Request]:
        """Every request the scheduler knows, by id."""
        return self._scheduler.requests

    def set_active_cap(self, cap: int) -> None:
        """The active cap for this step: upstream reads it only in the waiting loop."""
        self._scheduler.max_num_active_reqs = cap

    def free_kv_blocks(self) -> int:
        return self._scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def blocks_can_be_freed(self, request: Request) -> bool:
        """Whether preempting ``request`` would free its KV blocks."""
        return self._scheduler._request_blocks_can_be_freed(request)

    def preempt(self, request: Request) -> None:
        """Takes ``request`` out of ``running`` and preempts it (recomputed
        when it resumes), through the scheduler's ``_preempt_request``."""
        self._scheduler.running.remove(request)
        self._scheduler._preempt_request(request, time.monotonic())

    def mamba_aligned_split(
        self, request: Request, num_computed_tokens: int, num_new_tokens: int
    ) -> int:
        """Upstream's cut of the prefill chunk ``[num_computed_tokens,
        +num_new_tokens)`` under ``mamba_aligned``: a chunk that ends before the
        prefill does ends on a block boundary (possibly giving 0 tokens).
        ``num_computed_tokens`` may include a prefix-cache hit not yet applied."""
        return self._scheduler._mamba_block_aligned_split(
            request, num_new_tokens, num_computed_tokens - request.num_computed_tokens
        )

    def prefix_hit_tokens(self, request: Request) -> int:
        """The prefix-cache hit upstream's waiting loop would find for a waiting
        request now (its lookup; 0 once the request has computed tokens)."""
        if request.num_computed_tokens:
            return 0
        return self._scheduler._get_local_prefix_cache_hit(request)[1]

    def awaits_kv_transfer(self) -> bool:
        """Whether a waiting request's KV cache is being received by a KV
        connector: the worker reports it done only in a step's output, so the
        engine must keep stepping (upstream polls every 1 ms) until it is."""
        scheduler = self._scheduler
        if scheduler.connector is None:
            return False
        return any(
            request.status == WAITING_FOR_REMOTE_KVS
            for queue in (scheduler.waiting, scheduler.kv_holding_waiting)
            for request in queue
        )

    def awaits_asynchronous_work(self) -> bool:
        """Whether a waiting request depends on work that completes without any
        input reaching the engine (a structured-output grammar compiling in a
        thread pool, a KV transfer): only a later step notices it is done."""
        scheduler = self._scheduler
        return any(
            request.status in ASYNC_READY
            for queue in (scheduler.waiting, scheduler.kv_holding_waiting)
            for request in queue
        )


def full_attention_block_sizes(config: KVCacheConfig) -> tuple[int, ...] | None:
    """Each KV cache group's block size, or None unless every group is full
    attention."""
    specs = [group.kv_cache_spec for group in config.kv_cache_groups]
    if not specs or not all(isinstance(spec, FullAttentionSpec) for spec in specs):
        return None
    return tuple(spec.block_size for spec in specs)


def first_prefill_chunk(requests: list[Request]) -> Request | None:
    """The first scheduled request whose step ends inside its prefill (upstream
    sets ``is_prefill_chunk`` on each request it schedules), or None. A plain
    loop: CPython runs it twice as fast as ``any()`` over a generator."""
    for request in requests:
        if request.is_prefill_chunk:
            return request
    return None


def next_step_samples(request: Request) -> bool:
    """Whether the request's next computed position is a sampling one (it is
    decoding, or one position short of the end of its prefill)."""
    return request.num_computed_tokens >= request.num_tokens - 1


def refused_prefill_end(request: Request, num_computed_tokens: int) -> int:
    """Where the prefill of a request refused its sampling step stops: short of
    its sampling position and, in a multimodal request, before a media item not
    yet started whose placeholder reaches that position (its encoder output
    would otherwise be computed for tokens the step leaves out, then held in
    the encoder cache while the request waits for budget, and, with
    ``disable_chunked_mm_input``, the item would be split)."""
    sampling_position = end = request.num_tokens - 1
    for feature in request.mm_features:
        start = feature.mm_position.offset
        stop = start + feature.mm_position.length
        if num_computed_tokens < start <= sampling_position < stop:
            end = min(end, start)
    return end
