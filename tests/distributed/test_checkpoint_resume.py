"""Bit-exact resume on 2 gloo ranks: train 2N steps == train N, save, fresh engine, load, train N.

Dropout is on, so the losses also prove the RNG states are restored; the data loader is the
engine's own (mid-epoch position and epoch restored); a WarmupLR scheduler is stepping, fp16
has a dynamic loss scale, and the client state comes back.
"""

from __future__ import annotations

import checkpoint_cases as cases
import pytest

from shardwise.testing import run_distributed_cases

pytestmark = pytest.mark.distributed


def test_train_2n_equals_train_n_save_load_train_n_loss_for_loss(tmp_path):
    grid = [(0, "fp16"), (1, "bf16"), (2, "fp32"), (2, "fp16")]
    results = run_distributed_cases(
        cases.resume_is_bit_exact,
        [{"stage": s, "precision": p, "dir": str(tmp_path / f"s{s}{p}")} for s, p in grid],
        world_size=2,
        timeout=600,
    )
    for (stage, precision), ranks in zip(grid, results):
        for result in ranks:
            where = f"stage {stage} {precision}"
            assert result["resumed"] == result["reference"], where  # exact, loss for loss
            assert result["first"] != result["reference"], where  # (the losses do move)
            assert result["params_equal"] and result["optimizer_equal"], where
            assert result["lr_equal"] and result["scale_equal"], where
            assert result["counters"] == (4, 16, 0, 4), where  # global steps/samples, skipped, micro
            assert result["client"] == {"note": "hello", "epoch": 1}, where
            assert result["path"] == str(tmp_path / f"s{stage}{precision}" / "global_step4"), where
