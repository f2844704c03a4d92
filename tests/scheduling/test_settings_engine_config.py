"""The settings where vLLM builds its engine config (``engine_ext.hooks``,
``engine_ext.supported``): the scheduler chosen, the configurations refused
naming the option, and data parallel, which needs the store."""

from __future__ import annotations

import pytest
from vllm.config import KVTransferConfig
from vllm.engine.arg_utils import EngineArgs

from engine_ext import hooks
from engine_ext.plugin import register
from engine_ext.scheduler import OutputRateAsyncScheduler, OutputRateScheduler
from engine_ext.supported import check_supported
from pacing.settings.checks import SettingsError
from pacing.settings.model import OutputRateSettings
from pacing.settings.store import STORE_FLAG, StoreSettings
from tools.scheduler_harness import make_scheduler

register()

STORE_URL = "redis://127.0.0.1:6379/0"


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_engine_config_selects_the_matching_scheduler(tiny_model_dir, async_scheduling):
    engine_args = EngineArgs(
        model=tiny_model_dir,
        max_model_len=512,
        additional_config={"output_rate": {"default_rate": 10, "user_rates": {}}},
        async_scheduling=async_scheduling,
    )
    vllm_config = engine_args.create_engine_config()
    chosen = vllm_config.scheduler_config.scheduler_cls
    # The CPU platform forces synchronous scheduling; the choice follows vLLM's
    # resolved setting, not the flag.
    resolved = vllm_config.scheduler_config.async_scheduling
    assert chosen is (OutputRateAsyncScheduler if resolved else OutputRateScheduler)


def test_engine_config_without_pacing_keeps_upstream_scheduler(tiny_model_dir):
    vllm_config = EngineArgs(
        model=tiny_model_dir, max_model_len=512
    ).create_engine_config()
    assert vllm_config.scheduler_config.scheduler_cls is None


class _HashableConfig:
    """What vLLM also takes as ``additional_config``: an object with a hash."""

    def compute_hash(self) -> str:
        return "another-plugin"


def test_a_hashable_additional_config_object_leaves_pacing_off(tiny_model_dir):
    vllm_config = EngineArgs(
        model=tiny_model_dir, max_model_len=512, additional_config=_HashableConfig()
    ).create_engine_config()
    assert vllm_config.scheduler_config.scheduler_cls is None
    assert not OutputRateSettings.from_additional_config(_HashableConfig()).enabled


def test_another_custom_scheduler_is_refused(tiny_model_dir):
    engine_args = EngineArgs(
        model=tiny_model_dir,
        max_model_len=512,
        scheduler_cls="vllm.v1.core.sched.scheduler.Scheduler",
        additional_config={"output_rate": {"default_rate": 10}},
    )
    with pytest.raises(SettingsError, match="--scheduler-cls"):
        engine_args.create_engine_config()


def _vllm_config(tiny_model_dir):
    return make_scheduler(tiny_model_dir, default_rate=10).vllm_config


@pytest.mark.parametrize(
    ("mutate", "option"),
    [
        (
            lambda c: setattr(c.parallel_config, "data_parallel_size", 2),
            "--data-parallel-size",
        ),
        (
            lambda c: setattr(c.parallel_config, "pipeline_parallel_size", 2),
            "--pipeline-parallel-size",
        ),
        (lambda c: setattr(c, "ec_transfer_config", object()), "--ec-transfer-config"),
        (
            lambda c: setattr(c.cache_config, "kv_offloading_size", 1.0),
            "--kv-offloading-size",
        ),
        (
            lambda c: setattr(
                c.aux_output_config, "enable_return_routed_experts", True
            ),
            "aux output",
        ),
        (lambda c: setattr(c, "diffusion_config", object()), "diffusion"),
    ],
)
def test_unsupported_configurations_are_refused_naming_the_option(
    tiny_model_dir, mutate, option
):
    vllm_config = _vllm_config(tiny_model_dir)
    check_supported(vllm_config)  # the plain tiny model is fine
    mutate(vllm_config)
    with pytest.raises(SettingsError, match=option):
        check_supported(vllm_config)


def test_kv_connectors_run_with_pacing(tiny_model_dir):
    """Prefill/decode disaggregation: the decode server paces
    (tests/e2e/test_e2e_pd_disaggregation.py); KV offload stays refused."""
    vllm_config = _vllm_config(tiny_model_dir)
    vllm_config.kv_transfer_config = KVTransferConfig(
        kv_connector="ExampleConnector", kv_role="kv_consumer"
    )
    check_supported(vllm_config)
    vllm_config.cache_config.kv_offloading_size = 1.0
    with pytest.raises(SettingsError, match="--kv-offloading-size"):
        check_supported(vllm_config)


def test_hooks_fail_loudly_when_vllm_internals_moved():
    class Moved:
        pass

    with pytest.raises(RuntimeError, match="vLLM internals moved"):
        hooks._wrap(Moved, "_process_engine_step", lambda original, self: None)


def test_hooks_install_once():
    register()
    register()
    wrapped = EngineArgs.__dict__["create_engine_config"]
    assert getattr(wrapped, "__output_rate_hook__", False)
    assert not getattr(wrapped.__wrapped__, "__output_rate_hook__", False)


# -- data parallel needs the store ------------------------------------------------


def test_data_parallel_without_a_store_is_refused_naming_the_store_flag(
    tiny_model_dir,
):
    engine_args = EngineArgs(
        model=tiny_model_dir,
        max_model_len=512,
        data_parallel_size=2,
        additional_config={"output_rate": {"default_rate": 10}},
    )
    with pytest.raises(SettingsError) as error:
        engine_args.create_engine_config()
    message = str(error.value)
    assert "--data-parallel-size > 1 without a store" in message
    assert f"with {STORE_FLAG} redis://HOST:PORT/DB the ranks share" in message


def test_data_parallel_with_a_store_gets_our_scheduler(tiny_model_dir):
    engine_args = EngineArgs(
        model=tiny_model_dir,
        max_model_len=512,
        data_parallel_size=2,
        additional_config={
            "output_rate": {"default_rate": 10, "store": {"url": STORE_URL}}
        },
    )
    vllm_config = engine_args.create_engine_config()
    assert vllm_config.parallel_config.data_parallel_size == 2
    assert vllm_config.scheduler_config.scheduler_cls is OutputRateScheduler
    # Each rank reads the same store settings from the config it is handed.
    paced = OutputRateSettings.from_additional_config(vllm_config.additional_config)
    assert paced.store == StoreSettings(STORE_URL)


def test_a_store_lifts_only_the_data_parallel_refusal(tiny_model_dir):
    vllm_config = _vllm_config(tiny_model_dir)
    vllm_config.additional_config["output_rate"]["store"] = {"url": STORE_URL}
    vllm_config.parallel_config.data_parallel_size = 2
    check_supported(vllm_config)
    vllm_config.parallel_config.pipeline_parallel_size = 2
    with pytest.raises(SettingsError, match="--pipeline-parallel-size"):
        check_supported(vllm_config)
