"""Bit-exact resume on 2 gloo ranks: train 2N steps == train N, save, fresh engine, load, train N.

Dropout is on, so the losses also prove the RNG states are restored; the data loader is the
engine's own (mid-epoch position and epoch restored); a WarmupLR scheduler is stepping, fp16
has a dynamic loss scale, and the client state comes back. Stages 0-3, and optimizer /
parameter offload to host memory and to swap files (whose state the checkpoint must read
back from the files and write into them again on load).
"""

from __future__ import annotations

import pytest
from checkpoint_cases import resume_is_bit_exact as _resume

from shardwise.testing import run_distributed_cases

pytestmark = [pytest.mark.distributed, pytest.mark.numeric]


def _offload(stage: int, nvme: str | None, *, params: bool = False) -> dict:
    device = {"device": "nvme", "nvme_path": nvme} if nvme else {"device": "cpu"}
    zero = {"stage": stage, "reduce_bucket_size": 2000, "offload_optimizer": dict(device)}
    if params:
        zero["offload_param"] = dict(device)
    return {"zero_optimization": zero}


def test_train_2n_equals_train_n_save_load_train_n_loss_for_loss(tmp_path):
    nvme = str(tmp_path / "nvme")
    grid = [
        (0, "fp16", {}),
        (1, "bf16", {}),
        (2, "fp32", {}),
        (2, "fp16", {}),
        (3, "fp32", {}),
        (3, "bf16", {}),
        (3, "fp16", {}),
        # small parameters unsharded (16-bit, with fp32 masters), the rest FSDP2 DTensor shards
        (3, "bf16", {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 100}}),
        # optimizer state kept on the host / in swap files must be saved and restored too
        (2, "fp32", _offload(2, None)),
        (1, "bf16", _offload(1, nvme)),
        (3, "bf16", _offload(3, None, params=True)),
        (3, "fp32", _offload(3, nvme, params=True)),
    ]
    cases = [
        {"stage": s, "precision": p, "dir": str(tmp_path / f"case{i}"), "extra": extra}
        for i, (s, p, extra) in enumerate(grid)
    ]
    results = run_distributed_cases(_resume, cases, world_size=2, timeout=900)
    for i, ((stage, precision, extra), ranks) in enumerate(zip(grid, results)):
        for result in ranks:
            where = f"stage {stage} {precision} {extra}"
            assert result["resumed"] == result["reference"], where  # exact, loss for loss
            assert result["first"] != result["reference"], where  # (the losses do move)
            assert result["params_equal"] and result["optimizer_equal"], where
            assert result["lr_equal"] and result["scale_equal"], where
            assert result["counters"] == (4, 16, 0, 4), where  # global steps/samples, skipped, micro
            assert result["client"] == {"note": "hello", "epoch": 1}, where
            assert result["path"] == str(tmp_path / f"case{i}" / "global_step4"), where
            # nothing the optimizer reaches is a view invalidated by the in-place load
            assert result["unreadable_after_load"] == [], where
