"""compression_training through initialize on 2 gloo ranks: a small BERT-style model with weight
quantization and head pruning trains (loss goes down) at ZeRO stages 0-2 (fp32, and bf16 at 2), the schedule advances
every step and survives save/resume, and pruning at stage 3 is refused naming the key;
quantization (weights and activations) trains at stage 3, also on a model built under zero.Init."""

from __future__ import annotations

import compression_cases as cases
import pytest

from shardwise.testing import run_distributed

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize(("stage", "bf16"), [(0, False), (1, False), (2, False), (2, True)])
def test_quantization_and_head_pruning_train_and_resume(tmp_path, stage, bf16):
    results = run_distributed(cases.run, world_size=2, args=(str(tmp_path), stage, bf16), timeout=300)
    for result in results:
        losses = result["losses"]
        assert losses[-1] < losses[0]
        assert result["steps"] == result["resumed_steps"] == 12
        assert result["bits"] == result["resumed_bits"] == 6
        assert result["heads_on"] and result["resumed_heads"]
        assert "compression_training.head_pruning.shared_parameters.enabled" in result["stage3_error"]


@pytest.mark.parametrize("under_init", [False, True], ids=["stage3", "zero.Init"])
def test_quantization_trains_at_stage_3(tmp_path, under_init):
    results = run_distributed(cases.run_stage3, world_size=2, args=(str(tmp_path), under_init), timeout=300)
    for result in results:
        assert result["losses"][-1] < result["losses"][0]
        assert result["bits"] == result["resumed_bits"] == 6 and result["resumed_steps"] == 12
