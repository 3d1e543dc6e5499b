"""ZeroOneAdam (0/1 Adam) and OneBitLamb through the real engine at ZeRO stage 0 on 2 gloo ranks
(the demo GPT); each grid runs both optimizers in one spawn.

- before compression: bit-identical to the uncompressed update (Adam / Lamb without bias
  correction), and the step after differs;
- bytes per step after the warm-up (comms logger) at most 1/16 of the fp32 all-reduce's plus the
  scales and the norm scalar; 0/1 Adam's local steps make no collective at all;
- a checkpoint resumes bit-exactly: 0/1 Adam inside a local interval (ranks' parameters differ; bf16, fp16),
  1-bit Lamb in the compression phase, error buffers included;
- convergence within a stated margin: see test_converges_within_margin.
(Stages 1-3 are refused for every GradientExchangingOptimizer: test_onebit_adam_engine.py.)
"""

from __future__ import annotations

from pathlib import Path

import onebit_family_cases as cases
import pytest

from shardwise.comm.compressed_allreduce import compressed_bytes
from shardwise.testing import run_distributed_cases

pytestmark = pytest.mark.distributed
WORLD = 2


def test_uncompressed_steps_are_adam_and_lamb_then_compression_changes_the_step() -> None:
    grid = [
        {"kind": "zero_one", "agree": 4, "precision": "fp32"},  # var_update_scaler=4: steps 1-4 update v
        {"kind": "lamb", "agree": 3, "precision": "bf16"},  # freeze_step=3
    ]
    for case, per_rank in zip(grid, run_distributed_cases(cases.warm_up_is_uncompressed, grid, timeout=300)):
        for out in per_rank:
            assert out["warm_losses_equal"] and out["warm_params_equal"], (case, out)
            assert out["after_params_differ"], (case, out)


def test_bytes_per_step_and_local_steps_without_collectives() -> None:
    grid = [{"kind": "zero_one", "steps": 14}, {"kind": "lamb", "steps": 5}]
    results = run_distributed_cases(cases.traffic_per_step, grid, timeout=300)
    for case, per_rank in zip(grid, results):
        for out in per_rank:
            fp32_allreduce = 4 * out["numel"]
            one_bit = compressed_bytes(out["numel"], WORLD) + 4  # both stages and scales, + the norm scalar
            assert one_bit <= fp32_allreduce / 16 + WORLD * 8 + 2 * 4 + 4
            steps = dict(enumerate(out["steps"], start=1))
            if case["kind"] == "zero_one":
                # cases.ZERO_ONE_SCHEDULE: variance steps 1, 2, 4, 6; 1-bit 3, 5; syncs 7, 8, 10, 12; local 9, 11, 13, 14
                full, compressed, silent = (1, 2, 4, 6), (3, 5, 7, 8, 10, 12), (9, 11, 13, 14)
            else:  # freeze_step=2
                full, compressed, silent = (1, 2), (3, 4, 5), ()
            for t in full:
                assert steps[t][0] >= fp32_allreduce, (case, t, out)
            for t in compressed:
                assert 0 < steps[t][0] <= one_bit, (case, t, out)
            for t in silent:
                assert steps[t] == (0, 0), (case, t, out)  # no collective at all


def test_resume_is_bit_exact(tmp_path: Path) -> None:
    grid = [
        # 9 steps: inside a local interval (sync at 10), so the ranks' parameters differ at the save
        {"kind": "zero_one", "before": 9, "after": 5, "precision": "bf16", "dir": str(tmp_path / "zero_one")},
        # fp16: loss scaling, and local steps that still agree on the norm (overflow skips)
        {
            "kind": "zero_one",
            "before": 9,
            "after": 5,
            "precision": "fp16",
            "dir": str(tmp_path / "zero_one16"),
        },
        {"kind": "lamb", "before": 4, "after": 3, "precision": "fp32", "dir": str(tmp_path / "lamb")},
    ]
    for case, per_rank in zip(grid, run_distributed_cases(cases.resume_is_bit_exact, grid, timeout=400)):
        for out in per_rank:
            reference, again = out["losses"]
            assert reference == again, (case, out)
            assert out["params_equal"] and out["optimizer_differs"] == [], (case, out)
            assert out["errors_equal"] and out["errors_nonzero"], (case, out)
            assert out["ranks_differ_at_save"] == (case["kind"] == "zero_one"), (case, out)


def test_converges_within_margin() -> None:
    """N = 60 steps on the 24-sample TinyGPT task, 2 ranks, lr 1e-2: each must achieve at least 60%
    of its uncompressed reference's loss reduction (first step's loss minus the mean of the last 10).

    - 0/1 Adam (var_freeze_step 40, var_update_scaler 16 as DeepSpeed's default, local_step_scaler
      10, local_step_clipper 4) against Adam without bias correction: measured 75% (3.876 vs 3.779
      from 4.168). Its 1-bit steps before the freeze compress the *gradient* (not the smoother
      momentum, as 1-bit Adam does), and the embedding's gradient is mostly zeros, which 1 bit per
      element with one scale renders badly until error feedback repays it; on this short run
      that costs more than the local steps do (a variant with no 1-bit steps before the freeze
      reached 86%).
    - 1-bit Lamb (freeze_step 15) against Lamb without bias correction: measured 76% (3.864 vs
      3.767 from 4.168): frozen coefficients and compressed momentum.
    Both runs are seeded and deterministic; 60% leaves room for platform rounding while still
    failing a run that does not train (on this task the reference lowers the loss by ~10%, so a
    margin on the loss itself could not tell).
    """
    grid = [
        {
            "kind": "zero_one",
            "steps": 60,
            "schedule": {
                "var_freeze_step": 40,
                "var_update_scaler": 16,
                "local_step_scaler": 10,
                "local_step_clipper": 4,
            },
        },
        {"kind": "lamb", "steps": 60, "freeze": 15},
    ]
    for case, per_rank in zip(grid, run_distributed_cases(cases.converges, grid, timeout=500)):
        out = per_rank[0]
        onebit, reference = out["onebit"], out["reference"]
        assert onebit[0] == reference[0], case  # same model, same first batch
        tail_onebit, tail_reference = sum(onebit[-10:]) / 10, sum(reference[-10:]) / 10
        assert tail_reference < reference[0] * 0.95, (case, out)  # the task trains
        assert onebit[0] - tail_onebit >= 0.6 * (reference[0] - tail_reference), (
            case,
            tail_onebit,
            tail_reference,
        )
