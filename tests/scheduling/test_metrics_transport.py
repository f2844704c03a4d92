"""The metrics transport, engine core -> API process, through vLLM's real parts:
``SchedulerStats`` inside ``EngineCoreOutputs`` over vLLM's msgpack encoder and
decoder, then vLLM's ``StatLoggerManager`` with the plugin loggers vLLM itself
discovers, its logging stat logger and its ``PrometheusStatLogger``; values are
read back from the Prometheus registry that vLLM's ``/metrics`` serves.

No server needed; the tiny model only feeds ``ModelConfig``.
"""

from __future__ import annotations

import dataclasses
import logging
from types import SimpleNamespace

import pytest
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from vllm.config import ModelConfig, VllmConfig
from vllm.usage.usage_lib import UsageContext
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.metrics.loggers import (
    LoggingStatLogger,
    PrometheusStatLogger,
    StatLoggerManager,
    load_stat_logger_plugin_factories,
)
from vllm.v1.metrics.stats import SchedulerStats
from vllm.v1.request import RequestStatus
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from engine_ext import metrics
from engine_ext.payload_builder import (
    BandActivity,
    PayloadBuilder,
    TeamActivity,
    attach,
)
from engine_ext.payload_parser import parse, take_payload
from engine_ext.scheduler import PAYLOAD_INTERVAL_NS, OutputRateScheduler
from engine_ext.stats_payload import (
    DEFAULT_LIMIT_USER,
    OTHER_TEAM,
    OTHER_TIER,
    OTHER_USER,
    PAYLOAD_KEY,
    PAYLOAD_VERSION,
)
from pacing.accounting import Accounting
from pacing.bands import BandTable
from pacing.ceilings import Ceilings
from pacing.fair_share import FairShare
from pacing.limiter import OutputRateLimiter
from pacing.modes import Mode
from pacing.policy.model import Limits, Policy, User
from pacing.shared import ControlPlaneSnapshot
from pacing.store_stats import StoreStats
from pacing.teams import TeamTable
from tools.fake_clock import FakeClock
from tools.scheduler_harness import driven_scheduler, make_request, make_scheduler

MODEL = "tiny-output-rate"


@pytest.fixture(scope="module")
def vllm_config(tiny_model_dir: str) -> VllmConfig:
    model_config = ModelConfig(
        model=tiny_model_dir,
        served_model_name=MODEL,
        max_model_len=512,
        dtype="float32",
    )
    return VllmConfig(model_config=model_config)


@pytest.fixture
def manager(vllm_config: VllmConfig) -> StatLoggerManager:
    """vLLM's stat logger set-up as ``AsyncLLM`` builds it for the API server."""
    # vLLM adds its logging stat logger only when INFO is enabled; that logger is
    # the one a leftover payload would crash, so the test needs it present.
    logging.getLogger("vllm.v1.metrics.loggers").setLevel(logging.INFO)
    manager = StatLoggerManager(
        vllm_config=vllm_config,
        custom_stat_loggers=load_stat_logger_plugin_factories(),
        enable_default_loggers=True,
    )
    kinds = [type(logger) for logger in manager.stat_loggers]
    assert metrics.OutputRateStatLogger in kinds
    assert PrometheusStatLogger in kinds
    assert any(
        isinstance(
            getattr(logger, "per_engine_stat_loggers", {}).get(0), LoggingStatLogger
        )
        for logger in manager.stat_loggers
    ), kinds
    return manager


def engine_step(payload: dict, **stats_fields) -> SchedulerStats:
    """What the engine core sends for one step, after vLLM's own wire trip."""
    stats = SchedulerStats(**stats_fields)
    attach(stats, payload)
    wire = MsgpackEncoder().encode(EngineCoreOutputs(scheduler_stats=stats))
    received = MsgpackDecoder(EngineCoreOutputs).decode(wire)
    assert received.scheduler_stats is not None
    return received.scheduler_stats


def sample(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, {"model_name": MODEL, **labels})


def test_vllm_discovers_our_stat_logger_plugin() -> None:
    factories = load_stat_logger_plugin_factories()
    assert metrics.OutputRateStatLogger in factories, (
        "entry point missing: reinstall the package (pip install -e .)"
    )
    assert metrics.stat_logger_will_load()


def test_payload_reaches_vllms_registry_through_the_real_pipeline(
    manager: StatLoggerManager,
) -> None:
    accounting = Accounting()
    accounting.record("alice", "charged", 30)
    accounting.record("alice", "throttled_skips", 10)
    accounting.record("alice", "refunds", 2)
    accounting.record("req-id-from-a-request", "charged", 5)
    accounting.record("req-id-from-a-request", "throttled_preemptions", 1)
    update_limit = "/outputrate.v1.OutputRateControl/UpdateLimit"
    control = ControlPlaneSnapshot(
        limit_changes=1,
        config_reloads={"failure": 1},
        rpcs={(update_limit, "INTERNAL"): 1},
    )
    builder = PayloadBuilder()
    builder.observe_idle_wait(0.004)
    builder.observe_idle_wait(0.05)
    payload = builder.build(
        accounting=accounting,
        user_rates={"alice": 20},
        default_rate=100,
        throttled_requests=3,
        tracked_users=2,
        control=control,
    )
    stats = engine_step(payload, num_running_reqs=4)

    manager.record(scheduler_stats=stats, iteration_stats=None)
    manager.log()  # vLLM's logging stat logger reads the same stats

    assert stats.kv_connector_stats is None  # removed before vLLM's loggers
    charged = "vllm:output_rate_tokens_charged_total"
    assert sample(charged, user="alice") == 30
    assert sample(charged, user=OTHER_USER) == 5
    assert sample("vllm:output_rate_throttled_skips_total", user="alice") == 10
    assert sample("vllm:output_rate_refunds_total", user="alice") == 2
    preemptions = "vllm:output_rate_throttled_preemptions_total"
    assert sample(preemptions, user=OTHER_USER) == 1
    assert sample(preemptions, user="alice") == 0  # exists from the start
    assert sample("vllm:output_rate_throttled_requests") == 3
    assert sample("vllm:output_rate_tracked_users") == 2
    limit = "vllm:output_rate_limit_tokens_per_second"
    assert sample(limit, user="alice") == 20
    assert sample(limit, user=DEFAULT_LIMIT_USER) == 100
    assert sample("vllm:output_rate_idle_wait_seconds_count") == 2
    assert sample("vllm:output_rate_idle_wait_seconds_bucket", le="0.005") == 1
    assert sample("vllm:output_rate_idle_wait_seconds_bucket", le="0.05") == 2
    assert sample("vllm:output_rate_limit_changes_total") == 1
    reloads = "vllm:output_rate_config_reloads_total"
    assert sample(reloads, result="failure") == 1
    assert sample(reloads, result="success") == 0
    rpcs = "vllm:output_rate_control_rpcs_total"
    assert sample(rpcs, method=update_limit, code="INTERNAL") == 1
    # vLLM's own metrics come from the same registry: one /metrics, one target.
    assert sample("vllm:num_requests_running", engine="0") == 4
    assert b"req-id-from-a-request" not in generate_latest(REGISTRY)


def test_counters_accumulate_and_unlabelled_users_lose_their_series(
    manager: StatLoggerManager,
) -> None:
    accounting = Accounting()
    builder = PayloadBuilder()
    rates = {"alice": 20, "bob": 50}
    for _ in range(3):
        accounting.record("alice", "charged", 2)
        accounting.record("bob", "charged")
        payload = builder.build(
            accounting=accounting,
            user_rates=rates,
            default_rate=10,
            throttled_requests=0,
            tracked_users=2,
        )
        manager.record(scheduler_stats=engine_step(payload), iteration_stats=None)
    charged = "vllm:output_rate_tokens_charged_total"
    assert sample(charged, user="alice") == 6
    assert sample(charged, user="bob") == 3

    # bob's explicit limit is removed at runtime: his series go, he joins __other__.
    accounting.record("bob", "charged", 4)
    payload = builder.build(
        accounting=accounting,
        user_rates={"alice": 20},
        default_rate=10,
        throttled_requests=0,
        tracked_users=2,
    )
    manager.record(scheduler_stats=engine_step(payload), iteration_stats=None)
    assert sample(charged, user="bob") is None
    assert sample("vllm:output_rate_limit_tokens_per_second", user="bob") is None
    assert sample(charged, user=OTHER_USER) == 4


def test_mode_and_tiers_reach_vllms_registry_through_the_real_pipeline(
    manager: StatLoggerManager,
) -> None:
    limiter = OutputRateLimiter(
        100,
        {},
        tier_rates={"free": 20, "pro": 200},
        memberships={"alice": "free", "bob": "pro", "carol": "staff"},
        exempt_tiers={"staff"},
    )
    accounting = Accounting()
    accounting.record("alice", "charged", 4)
    accounting.record("alice", "shadow_skips", 3)
    accounting.record("bob", "charged", 9)
    accounting.record("bob", "refunds", 1)
    accounting.record("carol", "charged", 50)
    accounting.record("erin", "throttled_skips", 8)  # in no tier
    builder = PayloadBuilder()

    def step(mode: Mode) -> None:
        payload = builder.build(
            accounting=accounting,
            user_rates={},
            default_rate=100,
            throttled_requests=0,
            tracked_users=0,
            mode=mode,
            limiter=limiter,
        )
        manager.record(scheduler_stats=engine_step(payload), iteration_stats=None)

    step(Mode.SHADOW)
    assert {m.value: sample("vllm:output_rate_mode", mode=m.value) for m in Mode} == {
        "enforce": 0,
        "shadow": 1,
        "off": 0,
    }
    tier_charged = "vllm:output_rate_tier_tokens_charged_total"
    assert sample(tier_charged, tier="free") == 4
    assert sample(tier_charged, tier="pro") == 9
    assert sample(tier_charged, tier="staff") == 50
    assert sample("vllm:output_rate_tier_shadow_skips_total", tier="free") == 3
    assert sample("vllm:output_rate_tier_refunds_total", tier="pro") == 1
    assert sample("vllm:output_rate_tier_refunds_total", tier="free") == 0
    assert sample("vllm:output_rate_tier_throttled_skips_total", tier=OTHER_TIER) == 0
    tier_limit = "vllm:output_rate_tier_limit_tokens_per_second"
    assert sample(tier_limit, tier="free") == 20
    assert sample(tier_limit, tier="pro") == 200
    assert sample(tier_limit, tier="staff") is None  # exempt: unlimited

    # The kill switch; pro is removed (bob leaves it first), staff loses its
    # exemption and gets a rate.
    limiter.set_membership("bob", None, now_ns=0)
    limiter.set_tier_rate("pro", None, now_ns=0)
    limiter.set_tier_rate("staff", 5, now_ns=0)
    limiter.set_tier_exempt("staff", False, now_ns=0)
    accounting.record("alice", "charged", 1)
    step(Mode.OFF)
    assert sample("vllm:output_rate_mode", mode="off") == 1
    assert sample("vllm:output_rate_mode", mode="shadow") == 0
    assert sample(tier_charged, tier="free") == 5
    assert sample(tier_charged, tier="pro") is None
    assert sample(tier_limit, tier="pro") is None
    assert sample(tier_limit, tier="staff") == 5


def test_engine_late_time_reaches_vllms_registry_in_seconds(
    manager: StatLoggerManager,
) -> None:
    limiter = OutputRateLimiter(
        100, {"alice": 20}, tier_rates={"free": 20}, memberships={"bob": "free"}
    )
    accounting = Accounting()
    accounting.record("alice", "engine_late_ns", 150_000_000)
    accounting.record("bob", "engine_late_ns", 40_000_000)
    payload = PayloadBuilder().build(
        accounting=accounting,
        user_rates={"alice": 20},
        default_rate=100,
        throttled_requests=0,
        tracked_users=2,
        limiter=limiter,
    )
    manager.record(scheduler_stats=engine_step(payload), iteration_stats=None)
    late = "vllm:output_rate_engine_late_seconds_total"
    assert sample(late, user="alice") == pytest.approx(0.15)
    assert sample(late, user=OTHER_USER) == pytest.approx(0.04)
    tier_late = "vllm:output_rate_tier_engine_late_seconds_total"
    assert sample(tier_late, tier="free") == pytest.approx(0.04)


#: The prompt counters: accounting field -> (user, tier, team series).
PROMPT_SERIES = {
    "prompt_tokens_charged": (
        metrics.PROMPT_TOKENS_CHARGED,
        metrics.TIER_PROMPT_TOKENS_CHARGED,
        metrics.TEAM_PROMPT_TOKENS_CHARGED,
    ),
    "prompt_held_skips": (
        metrics.PROMPT_HELD_SKIPS,
        metrics.TIER_PROMPT_HELD_SKIPS,
        metrics.TEAM_PROMPT_HELD_SKIPS,
    ),
    "prompt_shadow_holds": (
        metrics.PROMPT_SHADOW_HOLDS,
        metrics.TIER_PROMPT_SHADOW_HOLDS,
        metrics.TEAM_PROMPT_SHADOW_HOLDS,
    ),
    "prompt_wait_ns": (
        metrics.PROMPT_WAIT_SECONDS,
        metrics.TIER_PROMPT_WAIT_SECONDS,
        metrics.TEAM_PROMPT_WAIT_SECONDS,
    ),
}


def test_prompt_counters_reach_vllms_registry_per_user_tier_and_team(
    vllm_config: VllmConfig,
) -> None:
    """The four prompt-budget counters go from the accounting to their exported
    series (the wait in seconds): per user only for the labelled users (those
    with an explicit limit), the rest under ``__other__``, born at zero; summed
    per tier and per team; a user losing its label joins ``__other__``."""
    assert {field: metrics.USER_COUNTERS[field] for field in PROMPT_SERIES} == {
        field: names[0] for field, names in PROMPT_SERIES.items()
    }
    assert {field: metrics.TIER_COUNTERS[field] for field in PROMPT_SERIES} == {
        field: names[1] for field, names in PROMPT_SERIES.items()
    }
    assert {field: metrics.TEAM_COUNTERS[field] for field in PROMPT_SERIES} == {
        field: names[2] for field, names in PROMPT_SERIES.items()
    }
    registry = CollectorRegistry()
    plugin = metrics.OutputRateStatLogger(vllm_config, [0], registry=registry)
    limiter = OutputRateLimiter(
        100, {"alice": 20}, tier_rates={"free": 20}, memberships={"bob": "free"}
    )
    table = TeamTable({"acme": 60}, {"alice": "acme", "bob": "acme"})
    accounting = Accounting()
    # alice: labelled (an explicit limit), in team acme.
    accounting.record("alice", "prompt_tokens_charged", 1200)
    accounting.record("alice", "prompt_held_skips", 3)
    accounting.record("alice", "prompt_wait_ns", 1_500_000_000)
    # bob: no explicit limit (only a tier's), in tier free and team acme.
    accounting.record("bob", "prompt_tokens_charged", 300)
    accounting.record("bob", "prompt_held_skips", 1)
    accounting.record("bob", "prompt_wait_ns", 250_000_000)
    # carol: an id taken from requests, in no tier or team.
    accounting.record("carol", "prompt_tokens_charged", 40)
    accounting.record("carol", "prompt_shadow_holds", 4)
    builder = PayloadBuilder()

    def step(user_rates: dict[str, int]) -> None:
        payload = builder.build(
            accounting=accounting,
            user_rates=user_rates,
            default_rate=100,
            throttled_requests=0,
            tracked_users=3,
            limiter=limiter,
            teams=TeamActivity(table, (), (), 0),
        )
        plugin.record(engine_step(payload), None)

    def values(label: str, value: str, kind: int) -> dict[str, float | None]:
        return {
            field: registry.get_sample_value(
                names[kind], {"model_name": MODEL, label: value}
            )
            for field, names in PROMPT_SERIES.items()
        }

    def row(charged: int, held: int, shadow: int, wait_s: float) -> dict:
        return {
            "prompt_tokens_charged": charged,
            "prompt_held_skips": held,
            "prompt_shadow_holds": shadow,
            "prompt_wait_ns": pytest.approx(wait_s),
        }

    step({"alice": 20})
    assert values("user", "alice", 0) == row(1200, 3, 0, 1.5)
    assert values("user", OTHER_USER, 0) == row(340, 1, 4, 0.25)
    assert values("tier", "free", 1) == row(300, 1, 0, 0.25)
    assert values("tier", OTHER_TIER, 1) == row(0, 0, 0, 0)
    assert values("team", "acme", 2) == row(1500, 4, 0, 1.75)
    assert values("team", OTHER_TEAM, 2) == row(0, 0, 0, 0)
    exposed = generate_latest(registry).decode()
    for user in ("bob", "carol"):
        assert f'user="{user}"' not in exposed  # ids never become labels
    prompt_lines = [
        line
        for line in exposed.splitlines()
        if line.startswith(metrics.PROMPT_WAIT_SECONDS)
    ]
    assert len(prompt_lines) == 2, prompt_lines  # alice and __other__ only

    # Deltas add up; alice's explicit limit goes: her series go with it and
    # her later prompts count under __other__ (and still in her team).
    accounting.record("alice", "prompt_wait_ns", 500_000_000)
    step({"alice": 20})
    assert values("user", "alice", 0)["prompt_wait_ns"] == pytest.approx(2.0)
    accounting.record("alice", "prompt_tokens_charged", 60)
    accounting.record("alice", "prompt_shadow_holds", 2)
    step({})
    assert set(values("user", "alice", 0).values()) == {None}
    assert values("user", OTHER_USER, 0) == row(400, 1, 6, 0.25)
    assert values("team", "acme", 2) == row(1560, 4, 2, 2.25)


def test_prompt_limits_are_gauges_of_the_labelled_users_and_the_default(
    vllm_config: VllmConfig,
) -> None:
    """The prompt-limit gauge: a labelled user's own prompt rate (a user with
    a prompt rate but no explicit limit is not labelled), the default prompt
    rate as ``__default__``; a rate or default that goes takes its sample."""
    registry = CollectorRegistry()
    plugin = metrics.OutputRateStatLogger(vllm_config, [0], registry=registry)
    builder = PayloadBuilder()

    def step(prompt_rates: dict[str, int], default: int) -> dict[str, float | None]:
        payload = builder.build(
            accounting=Accounting(),
            user_rates={"alice": 20, "bob": 30},
            default_rate=100,
            throttled_requests=0,
            tracked_users=0,
            prompt_user_rates=prompt_rates,
            default_prompt_rate=default,
        )
        plugin.record(engine_step(payload), None)
        return {
            user: registry.get_sample_value(
                metrics.PROMPT_LIMIT_TOKENS_PER_SECOND,
                {"model_name": MODEL, "user": user},
            )
            for user in ("alice", "bob", "carol", DEFAULT_LIMIT_USER)
        }

    assert step({"alice": 500, "carol": 700}, 2000) == {
        "alice": 500,
        "bob": None,  # labelled, but no prompt rate of its own
        "carol": None,  # a prompt rate, but not labelled
        DEFAULT_LIMIT_USER: 2000,
    }
    # The default prompt rate goes (0: none); bob gets one, alice loses hers.
    assert step({"bob": 300}, 0) == {
        "alice": None,
        "bob": 300,
        "carol": None,
        DEFAULT_LIMIT_USER: None,
    }
    assert (
        registry.get_sample_value(
            metrics.LIMIT_TOKENS_PER_SECOND, {"model_name": MODEL, "user": "alice"}
        )
        == 20
    )


def test_the_scheduler_hands_the_prompt_limits_to_the_payload(
    tiny_model_dir: str,
) -> None:
    """What ``make_stats`` builds carries the prompt table the policy in force
    sets: the labelled users' own prompt rates and the default."""
    scheduler = make_scheduler(
        tiny_model_dir, user_rates={"alice": 5, "bob": 6}, scheduler_cls=_StatsScheduler
    )
    shared = scheduler.output_rate_shared
    with shared.lock:
        shared.policy = Policy(
            default=Limits(100, prompt_tokens_per_second=4000),
            users={
                "alice": User(Limits(5, prompt_tokens_per_second=300)),
                "bob": User(Limits(6)),
                "carol": User(Limits(None, prompt_tokens_per_second=50)),
            },
        )
    payload = parse(take_payload(scheduler.make_stats_with_payload()))
    assert payload.prompt_limits == {"alice": 300}
    assert payload.default_prompt_limit == 4000
    with shared.lock:
        shared.policy = Policy(
            default=Limits(100),
            users={"alice": User(Limits(5)), "bob": User(Limits(6))},
        )
    payload = parse(take_payload(scheduler.make_stats_with_payload()))
    assert payload.prompt_limits == {}
    assert payload.default_prompt_limit is None


def test_borrowed_tokens_reach_vllms_registry_per_user_tier_and_team(
    vllm_config: VllmConfig,
) -> None:
    """Ceilings: tokens borrowed above a user's rate, per labelled user (the
    rest under ``__other__``), tier and team, born at zero; a refund after the
    payload that carried the borrowing never makes the counters go down."""
    assert (
        metrics.USER_COUNTERS["borrowed_tokens"],
        metrics.TIER_COUNTERS["borrowed_tokens"],
        metrics.TEAM_COUNTERS["borrowed_tokens"],
    ) == (
        "vllm:output_rate_borrowed_tokens_total",
        "vllm:output_rate_tier_borrowed_tokens_total",
        "vllm:output_rate_team_borrowed_tokens_total",
    )
    registry = CollectorRegistry()
    plugin = metrics.OutputRateStatLogger(vllm_config, [0], registry=registry)
    limiter = OutputRateLimiter(
        100, {"alice": 20}, tier_rates={"free": 20}, memberships={"bob": "free"}
    )
    table = TeamTable({"acme": 60}, {"alice": "acme", "bob": "acme"})
    accounting = Accounting()
    builder = PayloadBuilder()

    def step() -> dict[str, float | None]:
        payload = builder.build(
            accounting=accounting,
            user_rates={"alice": 20},
            default_rate=100,
            throttled_requests=0,
            tracked_users=3,
            limiter=limiter,
            teams=TeamActivity(table, (), (), 0),
        )
        plugin.record(engine_step(payload), None)
        series = {
            ("user", "alice"): metrics.BORROWED_TOKENS,
            ("user", OTHER_USER): metrics.BORROWED_TOKENS,
            ("tier", "free"): metrics.TIER_BORROWED_TOKENS,
            ("tier", OTHER_TIER): metrics.TIER_BORROWED_TOKENS,
            ("team", "acme"): metrics.TEAM_BORROWED_TOKENS,
            ("team", OTHER_TEAM): metrics.TEAM_BORROWED_TOKENS,
        }
        return {
            value: registry.get_sample_value(name, {"model_name": MODEL, label: value})
            for (label, value), name in series.items()
        }

    accounting.record("alice", "borrowed_tokens", 30)
    accounting.record("bob", "borrowed_tokens", 8)
    accounting.record("carol", "borrowed_tokens", 2)  # in no tier or team
    assert step() == {
        "alice": 30,
        OTHER_USER: 10,
        "free": 8,
        OTHER_TIER: 0,
        "acme": 38,
        OTHER_TEAM: 0,
    }
    assert 'user="carol"' not in generate_latest(registry).decode()
    # alice gets 5 refunded, then borrows 7: 2 more than she had reached.
    accounting.record("alice", "borrowed_tokens", -5)
    assert step()["alice"] == 30
    accounting.record("alice", "borrowed_tokens", 7)
    assert step() == {
        "alice": 32,
        OTHER_USER: 10,
        "free": 8,
        OTHER_TIER: 0,
        "acme": 40,
        OTHER_TEAM: 0,
    }


def _ceilings(policy: Policy, needy: tuple[str, ...]) -> Ceilings:
    """The ceilings of ``policy`` with a borrowing budget told that ``needy``
    waited at the last step's start."""
    ceilings = Ceilings(policy)
    base = OutputRateLimiter(100, {})
    ceilings.over(base, base.rate_of, Accounting(), base.burst_ns).lend_to(needy)
    return ceilings


def test_ceilings_and_blocked_borrowing_are_gauges_on_the_registry(
    vllm_config: VllmConfig,
) -> None:
    """The ceiling gauge: each labelled user's ceiling (its own, its tier's or
    the default), the default as ``__default__``; the borrowing gauge per
    engine, 1 while a holder within its rate waits, gone with the ceilings."""
    registry = CollectorRegistry()
    plugin = metrics.OutputRateStatLogger(vllm_config, [0, 1], registry=registry)
    builder = PayloadBuilder()
    with_ceilings = Policy(
        default=Limits(100, ceiling_tokens_per_second=150),
        users={
            "alice": User(Limits(20, ceiling_tokens_per_second=90)),
            "bob": User(Limits(30)),
            "carol": User(Limits(None, ceiling_tokens_per_second=500)),
        },
    )

    def step(ceilings: Ceilings, engine: int) -> dict[str, float | None]:
        payload = builder.build(
            accounting=Accounting(),
            user_rates={"alice": 20, "bob": 30},
            default_rate=100,
            throttled_requests=0,
            tracked_users=0,
            ceilings=ceilings,
        )
        plugin.record(engine_step(payload), None, engine_idx=engine)
        values = {
            user: registry.get_sample_value(
                metrics.CEILING_TOKENS_PER_SECOND, {"model_name": MODEL, "user": user}
            )
            for user in ("alice", "bob", "carol", DEFAULT_LIMIT_USER)
        }
        for index in ("0", "1"):
            values[f"engine {index}"] = registry.get_sample_value(
                metrics.BORROWING_BLOCKED, {"model_name": MODEL, "engine": index}
            )
        return values

    assert step(_ceilings(with_ceilings, ("bob",)), 1) == {
        "alice": 90,
        "bob": 150,  # the default ceiling
        "carol": None,  # a ceiling, but not labelled
        DEFAULT_LIMIT_USER: 150,
        "engine 0": None,
        "engine 1": 1,
    }
    assert step(_ceilings(with_ceilings, ()), 0)["engine 0"] == 0
    assert step(_ceilings(with_ceilings, ()), 1)["engine 1"] == 0
    # The ceilings go: their samples go with them.
    assert set(step(Ceilings(Policy(default=Limits(100))), 1).values()) == {
        None,
        0,  # engine 0's, until engine 0 says so
    }
    assert step(Ceilings(Policy(default=Limits(100))), 0)["engine 0"] is None


def test_the_scheduler_hands_the_ceilings_to_the_payload(tiny_model_dir: str) -> None:
    """What ``make_stats`` builds carries the ceilings of the policy in force:
    the labelled users', the default, and borrowing not blocked (nobody
    waits); none of them once no holder has a ceiling."""
    scheduler = make_scheduler(
        tiny_model_dir, user_rates={"alice": 5, "bob": 6}, scheduler_cls=_StatsScheduler
    )
    shared = scheduler.output_rate_shared
    with shared.lock:
        shared.policy = Policy(
            default=Limits(100, ceiling_tokens_per_second=300),
            users={
                "alice": User(Limits(5, ceiling_tokens_per_second=50)),
                "bob": User(Limits(6)),
            },
        )
    payload = parse(take_payload(scheduler.make_stats_with_payload()))
    assert payload.ceiling_limits == {"alice": 50, "bob": 300}
    assert payload.default_ceiling_limit == 300
    assert payload.borrowing_blocked is False
    with shared.lock:
        shared.policy = Policy(
            default=Limits(100),
            users={"alice": User(Limits(5)), "bob": User(Limits(6))},
        )
    payload = parse(take_payload(scheduler.make_stats_with_payload()))
    assert payload.ceiling_limits == {}
    assert payload.default_ceiling_limit is None
    assert payload.borrowing_blocked is None


def test_fair_share_metrics_reach_vllms_registry_through_the_real_pipeline(
    vllm_config: VllmConfig,
) -> None:
    """Weighted service (fractional units) and fair-share preemptions per user
    and per tier; the switch and the gap as gauges of the engine that sent
    them."""
    registry = CollectorRegistry()
    plugin = metrics.OutputRateStatLogger(vllm_config, [0, 1], registry=registry)
    limiter = OutputRateLimiter(
        100, {"alice": 50}, tier_rates={"pro": 200}, memberships={"bob": "pro"}
    )
    accounting = Accounting()
    accounting.record("alice", "fair_share_service", 300.5)
    accounting.record("bob", "fair_share_service", 12.25)
    accounting.record("bob", "fair_share_preemptions", 3)
    ledger = FairShare(enabled=True)
    ledger.counter.update({"alice": 400.0, "bob": 1424.0})
    ledger.backlogged = frozenset({"alice", "bob"})
    builder = PayloadBuilder()

    def step() -> None:
        payload = builder.build(
            accounting=accounting,
            user_rates={"alice": 50},
            default_rate=100,
            throttled_requests=0,
            tracked_users=2,
            limiter=limiter,
            fair_share=ledger,
        )
        plugin.record(engine_step(payload), None, engine_idx=1)

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"model_name": MODEL, **labels})

    step()
    assert value(metrics.FAIR_SHARE_SERVICE, user="alice") == 300.5
    assert value(metrics.FAIR_SHARE_SERVICE, user=OTHER_USER) == 12.25
    assert value(metrics.FAIR_SHARE_PREEMPTIONS, user=OTHER_USER) == 3
    assert value(metrics.FAIR_SHARE_PREEMPTIONS, user="alice") == 0
    assert value(metrics.TIER_FAIR_SHARE_SERVICE, tier="pro") == 12.25
    assert value(metrics.TIER_FAIR_SHARE_PREEMPTIONS, tier="pro") == 3
    assert value(metrics.FAIR_SHARE_ENABLED, engine="1") == 1
    assert value(metrics.FAIR_SHARE_SERVICE_GAP, engine="1") == 1024.0
    assert value(metrics.FAIR_SHARE_ENABLED, engine="0") is None

    accounting.record("alice", "fair_share_service", 0.5)
    ledger.enabled = False
    ledger.backlogged = frozenset()
    step()
    assert value(metrics.FAIR_SHARE_SERVICE, user="alice") == 301.0
    assert value(metrics.FAIR_SHARE_ENABLED, engine="1") == 0
    assert value(metrics.FAIR_SHARE_SERVICE_GAP, engine="1") == 0


def test_team_series_reach_vllms_registry_through_the_real_pipeline(
    vllm_config: VllmConfig,
) -> None:
    """Team counters sum their members' (exempt ones included), the limit is
    the team's shared rate, the member gauges are the sending engine's, and
    the member-seconds counters integrate them between payloads."""
    registry = CollectorRegistry()
    plugin = metrics.OutputRateStatLogger(vllm_config, [0, 1], registry=registry)
    table = TeamTable({"acme": 60, "beta": 20}, {"a": "acme", "b": "acme", "c": "beta"})
    limiter = OutputRateLimiter(
        100, {}, memberships={"b": "staff"}, exempt_tiers={"staff"}
    )
    accounting = Accounting()
    accounting.record("a", "charged", 4)
    accounting.record("a", "throttled_skips", 6)
    accounting.record("b", "charged", 9)  # exempt, still acme's member
    accounting.record("c", "fair_share_service", 1.5)
    accounting.record("erin", "charged", 50)  # in no team
    builder = PayloadBuilder()

    def step(now_ns: int, live: tuple[str, ...], throttled: tuple[str, ...]) -> None:
        payload = builder.build(
            accounting=accounting,
            user_rates={},
            default_rate=100,
            throttled_requests=len(throttled),
            tracked_users=len(live),
            limiter=limiter,
            teams=TeamActivity(table, live, throttled, now_ns),
        )
        plugin.record(engine_step(payload), None, engine_idx=1)

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"model_name": MODEL, **labels})

    step(0, ("a", "b", "c"), ("a",))
    assert value(metrics.TEAM_TOKENS_CHARGED, team="acme") == 13
    assert value(metrics.TEAM_TOKENS_CHARGED, team=OTHER_TEAM) == 0
    assert value(metrics.TEAM_THROTTLED_SKIPS, team="acme") == 6
    assert value(metrics.TEAM_FAIR_SHARE_SERVICE, team="beta") == 1.5
    assert value(metrics.TEAM_REFUNDS, team="beta") == 0
    assert value(metrics.TEAM_LIMIT_TOKENS_PER_SECOND, team="acme") == 60
    assert value(metrics.TEAM_LIMIT_TOKENS_PER_SECOND, team="beta") == 20
    assert value(metrics.TEAM_MEMBERS_STREAMING, team="acme", engine="1") == 2
    assert value(metrics.TEAM_THROTTLED_MEMBERS, team="acme", engine="1") == 1
    assert value(metrics.TEAM_MEMBERS_STREAMING, team="beta", engine="1") == 1
    assert value(metrics.TEAM_MEMBER_ACTIVE_SECONDS, team="acme") == 0

    # 2 s later: acme had 2 members streaming for 2 s, 1 of them throttled.
    # beta is removed (c leaves it first): its series go.
    table.set_membership("c", None)
    table.set_rate("beta", None)
    step(2_000_000_000, ("a",), ())
    assert value(metrics.TEAM_MEMBER_ACTIVE_SECONDS, team="acme") == 4.0
    assert value(metrics.TEAM_MEMBER_THROTTLED_SECONDS, team="acme") == 2.0
    assert value(metrics.TEAM_MEMBERS_STREAMING, team="acme", engine="1") == 1
    assert value(metrics.TEAM_THROTTLED_MEMBERS, team="acme", engine="1") == 0
    assert value(metrics.TEAM_TOKENS_CHARGED, team="beta") is None
    assert value(metrics.TEAM_LIMIT_TOKENS_PER_SECOND, team="beta") is None
    assert value(metrics.TEAM_MEMBERS_STREAMING, team="beta", engine="1") is None


def test_team_labels_are_bounded_like_users_on_the_registry(
    vllm_config: VllmConfig,
) -> None:
    """Teams beyond the user-label cap share the ``__other__`` series."""
    registry = CollectorRegistry()
    plugin = metrics.OutputRateStatLogger(vllm_config, [0], registry=registry)
    teams = {f"t{i}": 10 for i in range(4)}
    table = TeamTable(teams, {f"u{i}": team for i, team in enumerate(teams)})
    accounting = Accounting()
    for i in range(4):
        accounting.record(f"u{i}", "charged", 1)
    payload = PayloadBuilder(max_labelled_users=1).build(
        accounting=accounting,
        user_rates={},
        default_rate=100,
        throttled_requests=0,
        tracked_users=4,
        teams=TeamActivity(table, ("u1", "u2"), ("u2",), 0),
    )
    plugin.record(engine_step(payload), None)
    exposed = generate_latest(registry).decode()
    charged = [
        line
        for line in exposed.splitlines()
        if line.startswith(metrics.TEAM_TOKENS_CHARGED)
    ]
    assert len(charged) == 2, charged
    assert (
        registry.get_sample_value(
            metrics.TEAM_TOKENS_CHARGED, {"model_name": MODEL, "team": "t0"}
        )
        == 1
    )
    assert (
        registry.get_sample_value(
            metrics.TEAM_TOKENS_CHARGED, {"model_name": MODEL, "team": OTHER_TEAM}
        )
        == 3
    )
    assert (
        registry.get_sample_value(
            metrics.TEAM_THROTTLED_MEMBERS,
            {"model_name": MODEL, "team": OTHER_TEAM, "engine": "0"},
        )
        == 1
    )


def test_our_metrics_survive_vllm_rebuilding_its_prometheus_logger(
    manager: StatLoggerManager, vllm_config: VllmConfig
) -> None:
    payload = PayloadBuilder().build(
        accounting=Accounting(),
        user_rates={},
        default_rate=10,
        throttled_requests=1,
        tracked_users=0,
    )
    manager.record(scheduler_stats=engine_step(payload), iteration_stats=None)
    # Its constructor unregisters every collector named vllm:* on the registry.
    PrometheusStatLogger(vllm_config, [0])
    assert sample("vllm:output_rate_throttled_requests") == 1


def test_vllms_logging_stat_logger_would_crash_on_the_payload(
    vllm_config: VllmConfig,
) -> None:
    """Why the payload must be taken out before vLLM's loggers see it. If this
    starts passing, vLLM changed and ``take_payload`` may no longer be needed."""
    stats = engine_step({"v": 1})
    with pytest.raises(AttributeError, match="connector_cls"):
        LoggingStatLogger(vllm_config, 0).record(stats, None)


def test_a_malformed_payload_is_dropped_and_still_removed(
    vllm_config: VllmConfig, caplog: pytest.LogCaptureFixture
) -> None:
    registry = CollectorRegistry()
    plugin = metrics.OutputRateStatLogger(vllm_config, [0], registry=registry)
    stats = engine_step({"v": 999})
    with caplog.at_level(logging.WARNING, logger="vllm.engine_ext.metrics"):
        plugin.record(stats, None)
        plugin.record(engine_step({"v": 999}), None)
    assert stats.kv_connector_stats is None
    assert [r.message for r in caplog.records].count(
        "dropping malformed output-rate stats: payload version 999 is not "
        f"{PAYLOAD_VERSION}: engine core and API process run different "
        "engine_ext versions"
    ) == 1
    assert b"output_rate" not in generate_latest(registry)


def test_stats_without_payload_leave_no_series(vllm_config: VllmConfig) -> None:
    registry = CollectorRegistry()
    plugin = metrics.OutputRateStatLogger(vllm_config, [0], registry=registry)
    plugin.record(SchedulerStats(), None)
    plugin.record(None, None)
    assert b"vllm:output_rate" not in generate_latest(registry)
    assert PAYLOAD_KEY  # the key name the engine side uses is defined


@pytest.mark.parametrize(
    ("usage_context", "plugins", "expected"),
    [
        (UsageContext.OPENAI_API_SERVER, None, True),
        (UsageContext.OPENAI_API_SERVER, "output_rate", True),
        (UsageContext.OPENAI_API_SERVER, "something_else", False),
        (UsageContext.LLM_CLASS, None, False),
        (None, None, False),
    ],
)
def test_transport_is_enabled_only_where_our_stat_logger_consumes_it(
    monkeypatch: pytest.MonkeyPatch,
    usage_context: UsageContext | None,
    plugins: str | None,
    expected: bool,
) -> None:
    if plugins is None:
        monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    else:
        monkeypatch.setenv("VLLM_PLUGINS", plugins)
    assert metrics.transport_enabled(usage_context) is expected


# -- nothing we add can break vLLM's threads ----------------------------------


def test_a_surrogate_user_label_would_kill_vllms_encoder() -> None:
    """Why the payload must hold only strings that encode as strict UTF-8: vLLM's
    encoder raises, and in the engine core that ends its output thread."""
    stats = SchedulerStats()
    attach(stats, {"users": {"bad\ud800": {"charged": 1}}})
    with pytest.raises(UnicodeEncodeError):
        MsgpackEncoder().encode(EngineCoreOutputs(scheduler_stats=stats))


def test_a_payload_built_for_a_surrogate_user_crosses_vllms_wire(
    vllm_config: VllmConfig,
) -> None:
    """Defence in depth behind id validation: even a surrogate id that got into
    the limiter yields a payload vLLM encodes; its events count as other users'."""
    accounting = Accounting()
    accounting.record("bad\ud800", "charged", 4)
    accounting.record("alice", "charged", 1)
    payload = PayloadBuilder().build(
        accounting=accounting,
        user_rates={"bad\ud800": 3, "alice": 5},
        default_rate=1000,
        throttled_requests=0,
        tracked_users=2,
    )
    stats = engine_step(payload)  # vLLM's MsgpackEncoder and decoder
    registry = CollectorRegistry()
    metrics.OutputRateStatLogger(vllm_config, [0], registry=registry).record(
        stats, None
    )
    charged = "vllm:output_rate_tokens_charged_total"
    got = {"model_name": MODEL}
    assert registry.get_sample_value(charged, {**got, "user": OTHER_USER}) == 4
    assert registry.get_sample_value(charged, {**got, "user": "alice"}) == 1


def test_a_failing_record_logs_and_does_not_raise(
    vllm_config: VllmConfig,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry = CollectorRegistry()
    plugin = metrics.OutputRateStatLogger(vllm_config, [0], registry=registry)

    def broken(payload, engine) -> None:
        raise RuntimeError("bug in our exporter")

    payload = PayloadBuilder().build(
        accounting=Accounting(),
        user_rates={"alice": 5},
        default_rate=10,
        throttled_requests=2,
        tracked_users=1,
    )
    monkeypatch.setattr(plugin.metrics, "apply", broken)
    with caplog.at_level(logging.ERROR, logger="vllm.engine_ext.metrics"):
        for _ in range(3):
            stats = engine_step(payload)
            plugin.record(stats, None)  # must not raise into vLLM
            assert stats.kv_connector_stats is None  # still taken out
    logged = [r for r in caplog.records if r.name == "vllm.engine_ext.metrics"]
    assert [r.exc_info[0] for r in logged] == [RuntimeError, RuntimeError]  # 1, 2
    monkeypatch.undo()
    plugin.record(engine_step(payload), None)
    throttled = "vllm:output_rate_throttled_requests"
    assert registry.get_sample_value(throttled, {"model_name": MODEL}) == 2


class _StatsScheduler(OutputRateScheduler):
    """The real scheduler as the API server runs it: stats on, payload emitted."""

    def __init__(self, *args, **kwargs) -> None:
        entry = kwargs["vllm_config"].additional_config["output_rate"]
        entry["metrics"] = {"emit": True}
        kwargs["log_stats"] = True
        super().__init__(*args, **kwargs)


def test_make_stats_survives_a_failing_payload_build(
    tiny_model_dir: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    scheduler = make_scheduler(
        tiny_model_dir, user_rates={"alice": 5}, scheduler_cls=_StatsScheduler
    )
    stats = scheduler.make_stats()
    assert stats is not None and PAYLOAD_KEY in stats.kv_connector_stats

    def broken(**kwargs) -> dict:
        raise RuntimeError("bug in our payload builder")

    monkeypatch.setattr(scheduler.output_rate_stats, "build", broken)
    with caplog.at_level(logging.ERROR, logger="vllm.engine_ext.payload_builder"):
        for _ in range(3):
            # Every call builds (no interval), and must not raise into the core.
            stats = scheduler.make_stats_with_payload()
            assert stats is not None  # upstream's stats, sent without a payload
            assert stats.kv_connector_stats is None
            MsgpackEncoder().encode(EngineCoreOutputs(scheduler_stats=stats))
    logged = [r for r in caplog.records if r.name == "vllm.engine_ext.payload_builder"]
    assert [r.exc_info[0] for r in logged] == [RuntimeError, RuntimeError]  # 1, 2
    monkeypatch.undo()
    assert PAYLOAD_KEY in scheduler.make_stats_with_payload().kv_connector_stats


def test_payloads_are_built_at_most_every_payload_interval(tiny_model_dir: str) -> None:
    """A build costs a fraction of a tiny model's step: stats closer together
    than ``PAYLOAD_INTERVAL_NS`` carry upstream's figures alone, and the next
    payload's counter deltas include what they skipped."""
    clock = FakeClock()
    scheduler = make_scheduler(
        tiny_model_dir,
        user_rates={"u": 5},
        scheduler_cls=_StatsScheduler,
        clock=clock,
    )
    built = []
    reported = 0  # "u"'s charged tokens, summed over the payloads' deltas
    for _ in range(12):
        scheduler.accounting.record("u", "charged")
        stats = scheduler.make_stats()
        assert stats is not None
        raw = take_payload(stats)
        built.append(raw is not None)
        if raw is not None:
            reported += parse(raw).users.get("u", {}).get("charged", 0)
            assert reported == scheduler.accounting.of("u").charged  # all of it
        clock.advance_ms(PAYLOAD_INTERVAL_NS / 1e6 / 4)
    assert built == [True, False, False, False] * 3


# -- the store ------------------------------------------------------------------

MS = 1_000_000


def store_payload(builder: PayloadBuilder, stats: StoreStats) -> dict:
    return builder.build(
        accounting=Accounting(),
        user_rates={},
        default_rate=10,
        throttled_requests=0,
        tracked_users=0,
        store=stats,
    )


def test_store_metrics_reach_vllms_registry_through_the_real_pipeline(
    manager: StatLoggerManager,
) -> None:
    """Round trips by result, the latency histogram with the engine's own
    bucket counts and sum, token counters and both gauges; then deltas add up
    and the degraded gauge clears."""
    stats = StoreStats()
    stats.record_answered(300_000, claimed=8, granted=6, returned=0, live_engines=3)
    stats.record_answered(400_000, claimed=4, granted=4, returned=2, live_engines=3)
    stats.record_answered(2 * MS, claimed=1, granted=1, returned=5, live_engines=3)
    stats.record_failed(50 * MS, now_ns=1)  # a timeout: the bound, inclusive
    builder = PayloadBuilder()
    manager.record(
        scheduler_stats=engine_step(store_payload(builder, stats)),
        iteration_stats=None,
    )
    manager.log()

    trips = "vllm:output_rate_store_round_trips_total"
    assert sample(trips, engine="0", result="ok") == 3
    assert sample(trips, engine="0", result="error") == 1
    latency = "vllm:output_rate_store_round_trip_seconds"
    buckets = {
        le: sample(f"{latency}_bucket", engine="0", le=le)
        for le in ("0.00025", "0.0005", "0.001", "0.0025", "0.025", "0.05", "+Inf")
    }
    assert buckets == {
        "0.00025": 0,
        "0.0005": 2,
        "0.001": 2,
        "0.0025": 3,
        "0.025": 3,
        "0.05": 4,
        "+Inf": 4,
    }
    assert sample(f"{latency}_count", engine="0") == 4
    assert sample(f"{latency}_sum", engine="0") == pytest.approx(0.0527)
    assert sample("vllm:output_rate_store_tokens_claimed_total", engine="0") == 13
    assert sample("vllm:output_rate_store_tokens_granted_total", engine="0") == 11
    assert sample("vllm:output_rate_store_tokens_returned_total", engine="0") == 7
    assert sample("vllm:output_rate_store_degraded", engine="0") == 1
    assert sample("vllm:output_rate_store_live_engines", engine="0") == 3

    stats.record_answered(MS, claimed=2, granted=2, returned=0, live_engines=2)
    manager.record(
        scheduler_stats=engine_step(store_payload(builder, stats)),
        iteration_stats=None,
    )
    assert sample(trips, engine="0", result="ok") == 4
    assert sample(f"{latency}_bucket", engine="0", le="0.001") == 3
    assert sample(f"{latency}_count", engine="0") == 5
    assert sample(f"{latency}_sum", engine="0") == pytest.approx(0.0537)
    assert sample("vllm:output_rate_store_tokens_claimed_total", engine="0") == 15
    assert sample("vllm:output_rate_store_degraded", engine="0") == 0
    assert sample("vllm:output_rate_store_live_engines", engine="0") == 2


def test_store_series_are_born_at_zero_and_labelled_by_engine(
    vllm_config: VllmConfig,
) -> None:
    """The first payload creates every store series, at zero where nothing
    happened yet (rate() then sees the first increase), under the index of the
    engine core that sent it."""
    registry = CollectorRegistry()
    plugin = metrics.OutputRateStatLogger(vllm_config, [0, 1], registry=registry)
    payload = store_payload(PayloadBuilder(), StoreStats())
    plugin.record(engine_step(payload), None, engine_idx=1)

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(
            name, {"model_name": MODEL, "engine": "1", **labels}
        )

    for result in ("ok", "error"):
        assert value(metrics.STORE_ROUND_TRIPS, result=result) == 0
    for name in metrics.STORE_TOKEN_COUNTERS.values():
        assert value(name) == 0
    assert value(f"{metrics.STORE_ROUND_TRIP_SECONDS}_count") == 0
    assert value(metrics.STORE_DEGRADED) == 0
    assert value(metrics.STORE_LIVE_ENGINES) == 1
    assert (
        registry.get_sample_value(
            metrics.STORE_DEGRADED, {"model_name": MODEL, "engine": "0"}
        )
        is None
    )


def test_without_a_store_there_are_no_store_series(vllm_config: VllmConfig) -> None:
    registry = CollectorRegistry()
    plugin = metrics.OutputRateStatLogger(vllm_config, [0], registry=registry)
    payload = PayloadBuilder().build(
        accounting=Accounting(),
        user_rates={},
        default_rate=10,
        throttled_requests=0,
        tracked_users=0,
    )
    plugin.record(engine_step(payload), None)
    text = generate_latest(registry)
    assert b"vllm:output_rate_tracked_users" in text  # the payload was exported
    assert b"output_rate_store" not in text


def test_the_scheduler_reports_its_team_members_streaming_and_throttled(
    tiny_model_dir: str,
) -> None:
    """On vLLM's real Scheduler: acme (20 tok/s) binds with members a and b two
    streams each, so the payload counts both streaming and some throttled;
    between two payloads 500 ms apart the member-seconds grow by the counts
    the first one saw times 0.5 s."""
    scheduler, driver = driven_scheduler(
        tiny_model_dir,
        False,
        default_rate=10_000,
        scheduler_cls=_StatsScheduler,
        output_rate={
            "team_rates": {"acme": 20},
            "team_members": {"a": "acme", "b": "acme"},
        },
    )
    driver.add([make_request(user) for user in ("a", "a", "b", "b", "c")])
    for _ in range(50):
        driver.step()
    first = scheduler.make_stats_with_payload()
    assert first is not None
    payload = parse(take_payload(first))
    streaming, throttled = payload.team_members["acme"]
    assert streaming == 2
    assert throttled >= 1
    assert payload.teams == {"acme": 20}
    driver.clock.advance_ms(500)
    second = scheduler.make_stats_with_payload()
    assert second is not None
    later = parse(take_payload(second))
    assert later.team_member_ns["acme"] == (streaming * 500 * MS, throttled * 500 * MS)


# -- priority bands -------------------------------------------------------------

BANDS = ("interactive", "standard", "batch")


def test_band_series_reach_vllms_registry_per_band_and_engine(
    vllm_config: VllmConfig,
) -> None:
    """The band counters for exactly the bands in force, born at zero, gone
    with a band or with all bands; the waiting and fairness gauges per band
    and engine, each engine's own."""
    assert (
        metrics.BAND_TOKENS,
        metrics.BAND_WAIT_SECONDS,
        metrics.BAND_WAITING_REQUESTS,
        metrics.BAND_FAIRNESS,
    ) == (
        "vllm:output_rate_band_tokens_total",
        "vllm:output_rate_band_wait_seconds_total",
        "vllm:output_rate_band_waiting_requests",
        "vllm:output_rate_band_fairness",
    )
    registry = CollectorRegistry()
    plugin = metrics.OutputRateStatLogger(vllm_config, [0, 1], registry=registry)
    accounting = Accounting()  # engine 0's (engine 1 charges nothing)
    builders = {0: PayloadBuilder(), 1: PayloadBuilder()}
    queues = {
        engine: SimpleNamespace(queued=dict.fromkeys(BANDS, 0), wait_ns={})
        for engine in builders
    }
    table = BandTable(names=BANDS, default=1, users={"alice": 0})

    def step(table: BandTable, engine: int, now_ns: int = 0) -> None:
        payload = builders[engine].build(
            accounting=accounting if engine == 0 else Accounting(),
            user_rates={},
            default_rate=100,
            throttled_requests=0,
            tracked_users=0,
            bands=BandActivity(
                table=table,
                tier_of=lambda user: None,
                team_of=lambda user: None,
                weight_of=lambda user: 1.0,
                live={"alice": 1, "bob": 1},
                now_ns=now_ns,
                queue=queues[engine],
            ),
        )
        plugin.record(engine_step(payload), None, engine_idx=engine)

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"model_name": MODEL, **labels})

    accounting.record("alice", "charged", 10)
    accounting.record("bob", "charged", 4)
    queues[0].queued = {"interactive": 0, "standard": 0, "batch": 3}
    queues[0].wait_ns = {"batch": 1_500_000_000}
    step(table, 0)
    tokens = {band: value(metrics.BAND_TOKENS, band=band) for band in BANDS}
    assert tokens == {"interactive": 10, "standard": 4, "batch": 0}
    assert value(metrics.BAND_WAIT_SECONDS, band="batch") == 1.5
    assert value(metrics.BAND_WAIT_SECONDS, band="interactive") == 0
    waiting = metrics.BAND_WAITING_REQUESTS
    assert value(waiting, band="batch", engine="0") == 3
    assert value(waiting, band="standard", engine="0") == 0
    assert value(waiting, band="batch", engine="1") is None
    # A second later both are measured: alice alone in interactive, bob in
    # standard, each 1.
    accounting.record("alice", "charged", 5)
    step(table, 0, now_ns=1_000_000_000)
    assert value(metrics.BAND_TOKENS, band="interactive") == 15
    fairness = metrics.BAND_FAIRNESS
    assert value(fairness, band="interactive", engine="0") == 1.0
    assert value(fairness, band="standard", engine="0") == 1.0
    assert value(fairness, band="batch", engine="0") is None  # nobody's band
    # Engine 1 reports its own queue; engine 0's samples stay.
    queues[1].queued = {"interactive": 1, "standard": 0, "batch": 0}
    step(table, 1)
    assert value(waiting, band="interactive", engine="1") == 1
    assert value(waiting, band="batch", engine="0") == 3
    # batch is dropped: its counters go, and engine 0's gauges for it.
    two = BandTable(names=BANDS[:2], default=1, users={"alice": 0})
    step(two, 0, now_ns=2_000_000_000)
    assert value(metrics.BAND_TOKENS, band="batch") is None
    assert value(metrics.BAND_WAIT_SECONDS, band="batch") is None
    assert value(waiting, band="batch", engine="0") is None
    assert value(waiting, band="standard", engine="0") == 0
    assert value(metrics.BAND_TOKENS, band="interactive") == 15  # kept
    # The bands go: every band series goes (engine 1's gauges with its next
    # payload).
    step(BandTable(), 0)
    step(BandTable(), 1)
    assert "output_rate_band_" not in generate_latest(registry).decode()


def test_band_gauges_go_with_pacing_off_and_the_counters_stay(
    vllm_config: VllmConfig,
) -> None:
    registry = CollectorRegistry()
    plugin = metrics.OutputRateStatLogger(vllm_config, [0], registry=registry)
    builder = PayloadBuilder()
    queue = SimpleNamespace(queued={"interactive": 1, "batch": 0}, wait_ns={})
    table = BandTable(names=("interactive", "batch"), default=1)

    def step(mode: Mode) -> str:
        payload = builder.build(
            accounting=Accounting(),
            user_rates={},
            default_rate=100,
            throttled_requests=0,
            tracked_users=0,
            mode=mode,
            bands=BandActivity(
                table, lambda u: None, lambda u: None, lambda u: 1.0, {"a": 1}, 0, queue
            ),
        )
        plugin.record(engine_step(payload), None)
        return generate_latest(registry).decode()

    assert metrics.BAND_WAITING_REQUESTS in step(Mode.SHADOW)
    exposed = step(Mode.OFF)
    assert metrics.BAND_WAITING_REQUESTS not in exposed
    assert metrics.BAND_TOKENS in exposed


def recorded_payloads(scheduler) -> list:
    """The parsed payloads of ``scheduler``'s every ``make_stats`` from now
    on, appended to the list returned as they are built."""
    payloads = []
    make_stats = scheduler.make_stats

    def recorded(*args, **kwargs):
        stats = make_stats(*args, **kwargs)
        raw = take_payload(stats)
        if raw is not None:
            payloads.append(parse(raw))
        return stats

    scheduler.make_stats = recorded
    return payloads


def test_the_scheduler_hands_the_bands_to_the_payload(tiny_model_dir: str) -> None:
    """On vLLM's real Scheduler, two slots: an interactive user's two streams
    run while a batch user's two wait. The payloads carry the tokens per band
    (all of them: each user's in its band), two batch requests waiting, the
    fairness of each band (one user each: 1) and, once the batch requests
    start, their waits: from their arrival to the start of the step that
    started them."""
    doc = {"default": {"tokens_per_second": 100_000}}
    scheduler, driver = driven_scheduler(
        tiny_model_dir,
        False,
        default_rate=None,
        output_rate={"policy": doc},
        scheduler_cls=_StatsScheduler,
        max_num_seqs=2,
    )
    shared = scheduler.output_rate_shared
    with shared.lock:
        policy = shared.policy
        shared.policy = dataclasses.replace(
            policy,
            bands=BANDS,
            default=dataclasses.replace(policy.default, band="standard"),
            users={
                "i": User(Limits(band="interactive")),
                "b": User(Limits(band="batch")),
            },
        )
    driver.step()  # the first step start with bands: stays count from here
    payloads = recorded_payloads(scheduler)
    interactive = [make_request("i", max_tokens=100_000) for _ in range(2)]
    batch = [make_request("b", max_tokens=100_000) for _ in range(2)]
    arrived_ns = driver.clock()
    driver.add(interactive + batch)
    driver.run(150)
    scheduler.make_stats_with_payload()
    last = payloads[-1].bands
    assert last is not None
    assert last.names == BANDS
    assert last.waiting == {"interactive": 0, "standard": 0, "batch": 2}
    assert last.fairness == {"interactive": 1.0, "batch": 1.0}

    def total(field: str, band: str) -> int:
        return sum(getattr(p.bands, field).get(band, 0) for p in payloads if p.bands)

    assert total("tokens", "interactive") == scheduler.accounting.of("i").charged
    assert total("tokens", "batch") == 0
    assert total("wait_ns", "interactive") == 0  # started in the first step
    scheduler.finish_requests(
        [r.request_id for r in interactive], RequestStatus.FINISHED_ABORTED
    )
    started_ns = driver.clock()
    driver.step()  # starts the batch requests
    scheduler.make_stats_with_payload()
    assert total("wait_ns", "batch") == 2 * (started_ns - arrived_ns)
    assert payloads[-1].bands.waiting == dict.fromkeys(BANDS, 0)
    assert total("tokens", "batch") == scheduler.accounting.of("b").charged > 0
    # The bands go from the policy: so does their part of the payload.
    with shared.lock:
        shared.policy = policy
    scheduler.make_stats_with_payload()
    assert payloads[-1].bands is None


def test_a_band_keeps_the_tokens_of_a_user_forgotten_before_the_payload(
    tiny_model_dir: str,
) -> None:
    """On vLLM's real Scheduler: a user with no rate of its own (the default
    one, never labelled) runs one 50-token request to its end; the engine
    goes idle, and the idle heartbeat's clean-up forgets the user before the
    payload it then builds. The band's tokens are all 50 all the same."""
    doc = {"default": {"tokens_per_second": 100_000}}
    scheduler, driver = driven_scheduler(
        tiny_model_dir,
        False,
        default_rate=None,
        output_rate={"policy": doc},
        scheduler_cls=_StatsScheduler,
    )
    shared = scheduler.output_rate_shared
    with shared.lock:
        shared.policy = dataclasses.replace(
            shared.policy,
            bands=BANDS,
            default=dataclasses.replace(shared.policy.default, band="standard"),
        )
    payloads = recorded_payloads(scheduler)
    driver.add([make_request("s", max_tokens=50)])
    while scheduler.has_unfinished_requests():
        driver.step()
        assert len(payloads) < 60, "the request never ended"
    driver.settle()
    assert scheduler.accounting.total.charged == 50
    driver.clock.advance_ms(2_000)  # idle: the clean-up is due
    scheduler.cleanup_when_idle()  # what the idle heartbeat does first
    assert "s" not in scheduler.accounting.by_user()
    scheduler.make_stats_with_payload()
    tokens = sum(p.bands.tokens.get("standard", 0) for p in payloads if p.bands)
    assert tokens == 50
