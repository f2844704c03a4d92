"""The core's registration point (``pacing.attachments``): what attaches to the
scheduler, when it starts and stops, and the start-up checks."""

from __future__ import annotations

import pytest

from control.kinds import USERS
from control.plugin import register as register_control_plane
from control.runner import ControlPlane
from engine_ext.scheduler import OutputRateScheduler
from pacing import attachments
from pacing.settings.checks import SettingsError
from pacing.settings.model import ControlSettings, OutputRateSettings
from pacing.shared import SharedLimiter
from tests.control_harness import make_rig
from tests.settings_harness import settings_of
from tools.scheduler_harness import make_scheduler


class Part:
    """An attachment that records its stop in ``log``."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name = name
        self.log = log

    def stop(self) -> None:
        self.log.append(f"stop {self.name}")


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Empty registries for one test (vLLM's entry points may have filled them)."""
    monkeypatch.setattr(attachments, "_attach", [])
    monkeypatch.setattr(attachments, "_preflight", [])


PACED = settings_of(default_rate=10)


def test_attach_all_starts_what_is_registered_in_order_and_skips_none(registry):
    log: list[str] = []

    def first(shared: SharedLimiter, settings: OutputRateSettings) -> Part:
        log.append("first")
        return Part("first", log)

    def declines(shared: SharedLimiter, settings: OutputRateSettings) -> None:
        log.append("declines")

    attachments.register(first)
    attachments.register(declines)
    attachments.register(first)  # vLLM may load a plugin twice
    started = attachments.attach_all(make_rig(10).shared, PACED)
    assert log == ["first", "declines"]
    assert [part.name for part in started] == ["first"]


def test_a_failing_attach_stops_what_already_started(registry):
    log: list[str] = []

    def ok(shared: SharedLimiter, settings: OutputRateSettings) -> Part:
        return Part("ok", log)

    def broken(shared: SharedLimiter, settings: OutputRateSettings) -> Part:
        raise OSError("port taken")

    attachments.register(ok)
    attachments.register(broken)
    with pytest.raises(OSError, match="port taken"):
        attachments.attach_all(make_rig(10).shared, PACED)
    assert log == ["stop ok"]


def test_stop_all_stops_the_last_attached_first():
    log: list[str] = []
    attachments.stop_all([Part("a", log), Part("b", log)])
    assert log == ["stop b", "stop a"]


def test_preflight_runs_every_check_and_raises_the_first_refusal(registry):
    seen: list[OutputRateSettings] = []

    def passes(settings: OutputRateSettings) -> None:
        seen.append(settings)

    def refuses(settings: OutputRateSettings) -> None:
        raise SettingsError("--flag: no")

    attachments.register_preflight(passes)
    attachments.register_preflight(refuses)
    with pytest.raises(SettingsError, match="--flag: no"):
        attachments.preflight(PACED)
    assert seen == [PACED]


def test_a_configured_control_plane_without_its_plugin_is_logged(registry, caplog):
    settings = settings_of(default_rate=10, control=ControlSettings())
    with caplog.at_level("WARNING", logger="vllm.pacing.attachments"):
        assert attachments.attach_all(make_rig(10).shared, settings) == []
    assert "output_rate_control was not loaded" in caplog.text


# -- the scheduler is where things attach ---------------------------------------


def test_the_paced_scheduler_attaches_and_stops_at_shutdown(registry, tiny_model_dir):
    log: list[str] = []
    given: list[tuple[SharedLimiter, OutputRateSettings]] = []

    def part(shared: SharedLimiter, settings: OutputRateSettings) -> Part:
        given.append((shared, settings))
        return Part("part", log)

    attachments.register(part)
    scheduler = make_scheduler(tiny_model_dir, default_rate=10, user_rates={"a": 5})
    [(shared, settings)] = given
    assert shared is scheduler.output_rate_shared  # the facade, not a copy
    assert settings == settings_of(default_rate=10, user_rates={"a": 5})
    scheduler.shutdown()
    assert log == ["stop part"]
    assert scheduler.output_rate_attachments == []


def test_nothing_attaches_with_pacing_off(registry, tiny_model_dir):
    def part(shared: SharedLimiter, settings: OutputRateSettings) -> Part:
        raise AssertionError("attached with pacing off")

    attachments.register(part)
    scheduler = make_scheduler(tiny_model_dir, default_rate=None)
    assert scheduler.output_rate_attachments == []


def test_without_a_control_section_the_control_plane_does_not_attach(tiny_model_dir):
    # The offline LLM(additional_config=...) rule: a control plane only if asked.
    register_control_plane()
    scheduler = make_scheduler(tiny_model_dir, default_rate=10)
    assert scheduler.output_rate_attachments == []
    assert scheduler.output_rate_shared.control_snapshot() is None


def test_an_attached_control_plane_reports_its_counters_through_the_facade(
    tiny_model_dir,
):
    register_control_plane()

    def build(**kwargs):
        entry = kwargs["vllm_config"].additional_config["output_rate"]
        entry["control"] = {"address": "127.0.0.1:0"}
        return OutputRateScheduler(**kwargs)

    scheduler = make_scheduler(tiny_model_dir, default_rate=10, scheduler_cls=build)
    try:
        [plane] = scheduler.output_rate_attachments
        assert isinstance(plane, ControlPlane)
        plane.service.update(
            USERS, "limits/alice", {"tokens_per_second": 7}, allow_missing=True
        )
        snapshot = scheduler.output_rate_shared.control_snapshot()
        assert snapshot is not None and snapshot.limit_changes == 1
        assert scheduler.limiter.rate_of("alice") == 7
    finally:
        scheduler.shutdown()
