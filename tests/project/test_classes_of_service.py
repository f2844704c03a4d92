"""``benchmarks.classes_of_service``: its policies are valid and say what the
table says, the sides of its scheduler part differ only by bands and ceilings
(and fair share), the part runs end to end at a tiny size, and the borrow
rows read their runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.classes_of_service import (
    BANDS,
    BORROW_POLICY,
    COST_SIDES,
    HIGH_CEILING,
    HIGH_RATE,
    THROUGHPUT_SIDES,
    THROUGHPUT_USERS,
    borrow_rows,
    classes_policy,
    cost_side,
    main,
)
from pacing.ceilings import sets_ceilings
from pacing.policy.document import parse
from tools.measure import Bracketed


def test_the_classes_policy_puts_users_in_bands_by_turns_with_ceilings() -> None:
    policy = parse(classes_policy(["u0", "u1", "u2", "u3"])).policy
    assert policy.bands == BANDS
    table = policy.band_table()
    assert [table.index_of(u, None, None) for u in ("u0", "u1", "u2", "u3")] == [
        0,
        1,
        2,
        0,
    ]
    assert table.index_of("someone-else", None, None) == BANDS.index("standard")
    assert policy.users["u2"].limits.ceiling_tokens_per_second == HIGH_CEILING
    assert policy.default.ceiling_tokens_per_second == HIGH_CEILING
    assert policy.users["u2"].limits.tokens_per_second == HIGH_RATE
    assert policy.fair_share is None


def test_without_them_the_same_users_have_neither_bands_nor_ceilings() -> None:
    policy = parse(
        classes_policy(["u0", "u1"], bands=False, ceilings=False, fair=True)
    ).policy
    assert policy.bands == ()
    assert not policy.band_table().active
    assert not sets_ceilings(policy)
    assert policy.users["u1"].limits.tokens_per_second == HIGH_RATE
    assert policy.fair_share is True
    bands_only = parse(classes_policy(["u0"], ceilings=False)).policy
    assert bands_only.band_table().active and not sets_ceilings(bands_only)
    ceilings_only = parse(classes_policy(["u0"], bands=False)).policy
    assert ceilings_only.bands == () and sets_ceilings(ceilings_only)


def test_the_server_policies_parse() -> None:
    for policy in [*THROUGHPUT_SIDES.values(), BORROW_POLICY]:
        if policy is not None:
            parse(policy)
    classes = THROUGHPUT_SIDES["classes"]
    assert classes is not None
    parsed = parse(classes).policy
    assert parsed.fair_share is False
    assert {parsed.band_table().index_of(u, None, None) for u in THROUGHPUT_USERS} == {
        0,
        1,
        2,
    }


def test_the_scheduler_sides_differ_only_in_bands_ceilings_and_fair_share(
    tiny_model_dir: str,
) -> None:
    for name, features in COST_SIDES.items():
        side = cost_side(tiny_model_dir, name, users=6, slots=2, live=4)
        shared = side.scheduler.output_rate_shared
        assert side.scheduler._steps.bands.active() is features["bands"]
        assert shared.ceilings.active is features["ceilings"]
        assert shared.fair_share.enabled is features["fair"]
        assert shared.limiter.rate_of("user-5") == HIGH_RATE


def test_the_scheduler_part_runs_at_a_tiny_size(
    tiny_model_dir: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "results.json"
    main(
        [
            "--only",
            "scheduler",
            "--repeats",
            "1",
            "--steps",
            "6",
            "--users",
            "12",
            "--slots",
            "4",
            "--live",
            "10",
            "--warmup-steps",
            "10",
            "--model-dir",
            tiny_model_dir,
            "--json",
            str(out),
        ]
    )
    [run] = json.loads(out.read_text())["scheduler"]["runs"]
    assert set(run) == set(COST_SIDES)
    for side in run.values():
        assert side["seconds_per_step"] > 0
        assert side["running"] + side["waiting"] <= 10  # never above --live
        assert side["waiting"] > 0  # saturated: more requests than slots
        assert side["borrowed_tokens"] == 0  # ceilings never bind
    printed = capsys.readouterr().out
    assert "3 bands + ceilings" in printed
    assert "with fair share on for both" in printed


def test_the_borrow_rows_read_medians_the_borrowed_tokens_and_the_ratio() -> None:
    b = Bracketed(alone=[98.0, 100.0, 104.0], beside=[20.0, 22.0])
    others = Bracketed(alone=[1000.0, 1200.0, 1000.0], beside=[1100.0, 1000.0])
    b_row, borrowed_row, others_row = borrow_rows(b, [0.0, 2.0], others, [5.0, 7.0])
    assert b_row.ours == "100.0; 21.0"
    assert borrowed_row.ours == "1"
    assert (others_row.stock, others_row.ours) == ("1000", "1050")
    # Each run beside over the mean of the runs alone around it: 1.0 and 0.909.
    assert others_row.ratio == "0.955x"
    assert "b borrowed 6 a run" in others_row.measure
