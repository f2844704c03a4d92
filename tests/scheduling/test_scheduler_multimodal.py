"""Multimodal requests on vLLM's real Scheduler / AsyncScheduler, built for the
tiny VLM (its encoder budget and cache): a refused request's prefill stops
before an image it cannot finish, so that no encoder budget, compute or cache
goes to tokens the step leaves out, and image tokens are never charged."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request

from engine_ext.scheduling.upstream import refused_prefill_end
from tools.scheduler_harness import SYNC_AND_ASYNC as MODES
from tools.scheduler_harness import driven_scheduler, make_request
from tools.tiny_vlm import IMAGE_TOKENS, ensure_tiny_vlm

_ids = itertools.count()


@pytest.fixture(scope="module")
def tiny_vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny random-weight VLM, generated once per module (no network)."""
    return str(ensure_tiny_vlm(Path(tmp_path_factory.mktemp("vlm")) / "model"))


def image_request(
    user: str,
    prompt_len: int,
    image_at: int,
    max_tokens: int = 5,
    *more_images_at: int,
) -> Request:
    """A request of ``user`` with an image of ``IMAGE_TOKENS`` placeholder
    tokens at ``image_at`` (and at each of ``more_images_at``) in its prompt, as
    vLLM's processor hands it over."""
    n = next(_ids)
    return Request(
        request_id=f"mm-{n}",
        prompt_token_ids=[(i % 50) + 10 for i in range(prompt_len)],
        sampling_params=SamplingParams(
            max_tokens=max_tokens,
            ignore_eos=True,
            extra_args={"output_rate_user": user},
        ),
        pooling_params=None,
        mm_features=[
            MultiModalFeatureSpec(
                data=None,
                modality="image",
                identifier=f"image-{n}-{k}",
                mm_position=PlaceholderRange(offset=at, length=IMAGE_TOKENS),
            )
            for k, at in enumerate((image_at, *more_images_at))
        ],
        arrival_time=float(n),
    )


@pytest.mark.parametrize(
    ("images_at", "computed", "end"),
    [
        ((8,), 0, 39),  # text after the image: the second-to-last position
        ((24,), 0, 24),  # the image holds the last position: stop before it
        ((24,), 24, 39),  # the image reached already: nothing to stop before
        ((24,), 30, 39),  # the image begun: it is in the encoder cache already
        ((4, 24), 0, 24),  # only the image holding the last position counts
    ],
)
def test_where_a_refused_prefill_stops(images_at, computed, end):
    request = image_request("u", 40, *images_at[:1], 5, *images_at[1:])
    assert refused_prefill_end(request, computed) == end


def test_a_refused_text_prefill_stops_at_its_second_to_last_position():
    assert refused_prefill_end(make_request("u", prompt_len=40), 0) == 39


def spend_burst(driver, user: str) -> None:
    """One text request of ``user`` (limit 1 tok/s) takes its burst."""
    driver.add([make_request(user, prompt_len=4, max_tokens=50)])
    driver.step()


@MODES
@pytest.mark.parametrize(
    "setting", [{}, {"max_num_active_seqs": 8}], ids=["no_cap", "active_cap"]
)
def test_a_refused_prefill_stops_before_an_image_that_reaches_its_last_position(
    tiny_vlm_dir, async_scheduling, setting
):
    scheduler, driver = driven_scheduler(
        tiny_vlm_dir, async_scheduling, default_rate=1, **setting
    )
    spend_burst(driver, "u")
    # The prompt ends with the image: its placeholder holds the sampling position.
    late = image_request("u", prompt_len=40, image_at=40 - IMAGE_TOKENS)
    driver.add([late])
    output = driver.step()
    assert output.num_scheduled_tokens.get(late.request_id) == 40 - IMAGE_TOKENS
    assert late.request_id not in output.scheduled_encoder_inputs
    assert not scheduler.encoder_cache_manager.get_cached_input_ids(late)
    accounting = scheduler.accounting.of("u")
    assert accounting.charged == 1  # the first request's token only
    assert accounting.throttled_skips >= 1
    # With budget again the rest of the prompt, the image with it, runs and
    # samples; the image's encoder output is freed once computed.
    for _ in range(8):
        driver.step(step_ms=1000)
        if late.num_output_tokens:
            break
    assert late.num_output_tokens >= 1
    # Freed once a step's output shows the image computed (async: a step later).
    driver.run(2, step_ms=1000)
    encoded = [late.request_id in o.scheduled_encoder_inputs for o in driver.outputs]
    assert encoded.count(True) == 1
    assert not scheduler.encoder_cache_manager.get_cached_input_ids(late)


@MODES
def test_a_refused_request_leaves_the_encoder_budget_to_a_user_with_budget(
    tiny_vlm_dir, async_scheduling
):
    scheduler, driver = driven_scheduler(
        tiny_vlm_dir,
        async_scheduling,
        default_rate=1,
        user_rates={"fast": 100_000},
        max_num_batched_tokens=128,
    )
    # One image's worth of encoder work per step.
    scheduler.max_num_encoder_input_tokens = IMAGE_TOKENS
    spend_burst(driver, "slow")
    slow = image_request("slow", prompt_len=200, image_at=200 - IMAGE_TOKENS)
    driver.add([slow])
    first = driver.step()  # a prefill chunk that samples nothing
    assert first.num_scheduled_tokens[slow.request_id] == 128
    fast = image_request("fast", prompt_len=40, image_at=40 - IMAGE_TOKENS)
    driver.add([fast])
    output = driver.step()
    # The refused request stops before its image and encodes nothing ...
    assert output.num_scheduled_tokens[slow.request_id] == 200 - IMAGE_TOKENS - 128
    assert slow.request_id not in output.scheduled_encoder_inputs
    assert not scheduler.encoder_cache_manager.get_cached_input_ids(slow)
    # ... so the user with budget gets the step's encoder budget: its whole
    # prompt runs, its image encoded, and it samples in this step.
    assert output.num_scheduled_tokens[fast.request_id] == 40
    assert output.scheduled_encoder_inputs[fast.request_id] == [0]
    assert fast.request_id in driver.sampled[-1]


@MODES
def test_a_refused_prefill_still_encodes_an_image_it_computes_whole(
    tiny_vlm_dir, async_scheduling
):
    scheduler, driver = driven_scheduler(tiny_vlm_dir, async_scheduling, default_rate=1)
    spend_burst(driver, "u")
    # Text after the image: the refused prefill runs to its second-to-last
    # position, the image in it, and the image's encoder output is freed.
    late = image_request("u", prompt_len=40, image_at=8)
    driver.add([late])
    output = driver.step()
    assert output.num_scheduled_tokens[late.request_id] == 39
    assert output.scheduled_encoder_inputs[late.request_id] == [0]
    driver.step()
    assert not scheduler.encoder_cache_manager.get_cached_input_ids(late)
    assert late.num_output_tokens == 0


@MODES
def test_only_output_tokens_of_image_requests_are_charged(
    tiny_vlm_dir, async_scheduling
):
    scheduler, driver = driven_scheduler(
        tiny_vlm_dir, async_scheduling, default_rate=100_000
    )
    requests = [
        image_request("u", prompt_len=60, image_at=10 * k, max_tokens=7)
        for k in range(3)
    ]
    driver.add(requests)
    for _ in range(20):
        driver.step()
    assert all(r.num_output_tokens == 7 for r in requests)
    assert scheduler.accounting.of("u").charged == 3 * 7
