"""compression_training through initialize on 2 gloo ranks: a small BERT-style model with weight
quantization and head pruning trains (loss goes down) at ZeRO stages 0-2 (fp32, and bf16 at 2), the schedule advances
every step and survives save/resume, and pruning at stage 3 is refused naming the key;
quantization (weights and activations) trains at stage 3, also on a model built under zero.Init."""

from __future__ import annotations

import compression_cases as cases
import pytest

from shardwise.testing import run_distributed_cases

pytestmark = pytest.mark.distributed


PRUNING = [(0, False), (1, False), (2, False), (2, True)]
UNDER_INIT = [False, True]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[tuple, list[dict]]:
    """The six trainings in one spawn (each builds, seeds and checkpoints its own model, in its own
    directory), so the ranks set up the group once; a failing case is named by run_distributed_cases."""
    grid = [
        {
            "kind": "pruning",
            "stage": stage,
            "bf16": bf16,
            "tmp": str(tmp_path_factory.mktemp(f"s{stage}-{bf16}")),
        }
        for stage, bf16 in PRUNING
    ] + [
        {"kind": "stage3", "under_init": under, "tmp": str(tmp_path_factory.mktemp(f"stage3-{under}"))}
        for under in UNDER_INIT
    ]
    results = run_distributed_cases(cases.run_case, grid, world_size=2, timeout=900)
    keys = [("pruning", stage, bf16) for stage, bf16 in PRUNING] + [("stage3", under) for under in UNDER_INIT]
    return dict(zip(keys, results, strict=True))


@pytest.mark.parametrize(("stage", "bf16"), PRUNING)
def test_quantization_and_head_pruning_train_and_resume(runs, stage, bf16):
    results = runs[("pruning", stage, bf16)]
    for result in results:
        losses = result["losses"]
        assert losses[-1] < losses[0]
        assert result["steps"] == result["resumed_steps"] == 12
        assert result["bits"] == result["resumed_bits"] == 6
        assert result["heads_on"] and result["resumed_heads"]
        assert "compression_training.head_pruning.shared_parameters.enabled" in result["stage3_error"]


@pytest.mark.parametrize("under_init", UNDER_INIT, ids=["stage3", "zero.Init"])
def test_quantization_trains_at_stage_3(runs, under_init):
    results = runs[("stage3", under_init)]
    for result in results:
        assert result["losses"][-1] < result["losses"][0]
        assert result["bits"] == result["resumed_bits"] == 6 and result["resumed_steps"] == 12
