"""Progressive layer drop in the real engine on 2 gloo ranks: the forward receives DeepSpeed's
schedule, the schedule survives a resume, and a model that drops layers runs fewer blocks and trains."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from pld_cases import GAMMA, THETA, effect_on_blocks_and_loss, thetas_through_a_resume

from shardwise.testing import run_distributed_cases

pytestmark = [pytest.mark.distributed]


def _expected(steps: int, gas: int = 2) -> list[float]:
    """Forward of optimizer step s (1-based): 1.0 for s <= 2, then theta(s - 2) (updated before the increment)."""
    out = []
    for s in range(1, steps + 1):
        value = 1.0 if s <= 2 else (1 - THETA) * math.exp(-GAMMA * (s - 2)) + THETA
        out += [value] * gas
    return out


def test_the_forward_receives_the_schedule_and_a_resume_continues_it(tmp_path: Path) -> None:
    cases = [{"stage": 0, "dir": str(tmp_path / "s0")}, {"stage": 3, "dir": str(tmp_path / "s3")}]
    for case, ranks in zip(cases, run_distributed_cases(thetas_through_a_resume, cases, timeout=600)):
        for result in ranks:
            expected = _expected(6)
            assert result["thetas"][:-1] == pytest.approx(expected, rel=0, abs=0), case
            assert result["thetas"][-1] is None  # the evaluation forward gets nothing
            assert result["theta_at_save"] == result["theta_after_load"] == expected[6]
            assert result["resumed_thetas"] == pytest.approx(expected[6:], rel=0, abs=0), case


def test_dropping_layers_runs_fewer_blocks_and_still_trains() -> None:
    cases = [{"stage": 2}]
    for ranks in run_distributed_cases(effect_on_blocks_and_loss, cases, timeout=600):
        for result in ranks:
            plain, pld = result["plain"], result["pld"]
            assert plain["blocks"] == 12 * 2 * 4  # every block of every micro batch
            assert pld["blocks"] < 0.85 * plain["blocks"]
            assert sum(plain["last"]) < 0.9 * sum(plain["first"])  # the task is learnable in 12 steps
            assert sum(pld["last"]) < 0.9 * sum(pld["first"])  # and is learnt with layers dropped
            assert result["theta_api_off"] is None and 0.5 < result["theta_api"] < 1.0
