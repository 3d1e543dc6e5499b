"""OneBitAdam through the real engine at ZeRO stage 0 on 2 gloo ranks (the demo GPT).

- warm-up: bit-identical to Adam without bias correction (DeepSpeed's 1-bit Adam update);
- after it: the gradient all-reduce is gone, and the bytes one rank sends per step (comms
  logger) are at most 1/16 of the fp32 all-reduce's, plus the scales and the norm scalar;
- a checkpoint taken in the compressed phase resumes bit-exactly (error buffers per rank);
- convergence: see test_converges_within_margin_of_adam;
- stages 1-3 are refused with a ConfigError naming zero_optimization.stage.
"""

from __future__ import annotations

from pathlib import Path

import onebit_cases as cases
import pytest

from shardwise.testing import run_distributed_cases

pytestmark = pytest.mark.distributed


def test_warm_up_is_adam_then_compression_changes_the_step() -> None:
    grid = [{"freeze": 3, "precision": "fp32"}, {"freeze": 2, "precision": "bf16"}]
    for case, per_rank in zip(grid, run_distributed_cases(cases.warm_up_is_adam, grid, timeout=300)):
        for out in per_rank:
            assert out["warm_losses_equal"] and out["warm_params_equal"], (case, out)
            assert out["after_params_differ"], (case, out)


def test_bytes_per_step_after_warm_up_are_a_sixteenth_of_fp32() -> None:
    (per_rank,) = run_distributed_cases(cases.bytes_per_step, [{}], timeout=300)
    for out in per_rank:
        fp32_allreduce = 4 * out["numel"]
        assert out["warm"] >= fp32_allreduce  # warm-up: the whole gradient, fp32
        world = 2
        # 1/16 of fp32 (n/8 + n/16 for two ranks, padded to 16 elements) + 2 scales + the norm scalar
        allowance = fp32_allreduce / 16 + world * 8 + 2 * 4 + 4
        for step in out["compressed"]:
            assert step <= allowance, out
        assert "all_to_all_single" in out["ops"], out


def test_resume_in_the_compressed_phase_is_bit_exact(tmp_path: Path) -> None:
    grid = [
        {"dir": str(tmp_path / "fp32"), "precision": "fp32"},
        {"dir": str(tmp_path / "fp16"), "precision": "fp16"},
    ]
    for case, per_rank in zip(grid, run_distributed_cases(cases.resume_is_bit_exact, grid, timeout=300)):
        for out in per_rank:
            reference, again = out["losses"]
            assert reference == again, (case, out)
            assert out["params_equal"] and out["optimizer_equal"], (case, out)
            assert out["errors_equal"] and out["errors_nonzero"], (case, out)


def test_converges_within_margin_of_adam() -> None:
    """N = 60 steps (warm-up 15) on the 24-sample TinyGPT task, 2 ranks: OneBitAdam must achieve at
    least 80% of Adam's loss reduction (first step's loss minus the mean of the last 10).

    Why this margin: on this task Adam lowers the loss by about 9% in 60 steps, so a margin on the
    loss itself (say 5%) would accept a run that did not train; a share of the reduction cannot.
    1-bit Adam is not expected to match Adam step for step (its momentum is quantised and its
    variance frozen after warm-up); measured here it reaches 94% of Adam's reduction (3.804 vs
    3.779 from 4.168), deterministic (seeded), so 80% leaves room for platform rounding only.
    """
    (per_rank,) = run_distributed_cases(cases.converges_like_adam, [{"freeze": 15, "steps": 60}], timeout=400)
    out = per_rank[0]
    onebit, adam = out["onebit"], out["adam"]
    assert onebit[0] == adam[0]  # same model, same first batch
    tail_onebit, tail_adam = sum(onebit[-10:]) / 10, sum(adam[-10:]) / 10
    assert tail_adam < adam[0] * 0.95, out  # the task trains
    assert onebit[0] - tail_onebit >= 0.8 * (adam[0] - tail_adam), (tail_onebit, tail_adam, adam[0])


@pytest.mark.parametrize("stage", [1, 2])
def test_sharded_stages_are_refused_naming_the_key(stage: int) -> None:
    (per_rank,) = run_distributed_cases(cases.later_stage_is_refused, [{"stage": stage}], timeout=120)
    for message in per_rank:
        assert "zero_optimization.stage" in message and "stage 0" in message, message
