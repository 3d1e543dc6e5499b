"""Checkpoints written by DeepSpeed 0.19.8 (stages 0-3, 2 CPU ranks; tests/fixtures) load into shardwise.

The fixtures record DeepSpeed's own full fp32 weights and Adam moments at save time and the
losses of the two steps it ran after saving; shardwise must reproduce the state exactly and
continue with the same losses (to float rounding: the two engines' AdamW kernels and
reductions are not the same code).
"""

from __future__ import annotations

import math
from pathlib import Path

import checkpoint_cases as cases
import pytest

from shardwise.testing import run_distributed_cases

pytestmark = pytest.mark.distributed
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "deepspeed_ckpt"


def test_deepspeed_checkpoints_of_every_stage_load_and_continue(tmp_path):
    grid = [(0, 2), (1, 1), (2, 2), (3, 2)]  # (DeepSpeed stage saved, shardwise stage loading it)
    results = run_distributed_cases(
        cases.import_deepspeed,
        [{"dir": str(FIXTURES / f"stage{ds}"), "into_stage": into} for ds, into in grid],
        world_size=2,
        timeout=600,
    )
    for (ds_stage, into), ranks in zip(grid, results):
        for result in ranks:
            where = f"DeepSpeed stage {ds_stage} -> shardwise stage {into}"
            assert all(result["checks"].values()), (where, result["checks"])
            assert result["global_steps"] == 4 and result["client_has_ds_config"], where
            assert result["path"].endswith("model_states.pt"), where
            assert all(
                math.isclose(a, b, rel_tol=1e-5) for a, b in zip(result["losses"], result["expected_losses"])
            ), (where, result["losses"], result["expected_losses"])


def test_a_deepspeed_checkpoint_loads_on_another_world_size():
    (ranks,) = run_distributed_cases(
        cases.import_deepspeed,
        [{"dir": str(FIXTURES / "stage2"), "into_stage": 1}],
        world_size=1,
        timeout=300,
    )
    assert all(ranks[0]["checks"].values()) and ranks[0]["global_steps"] == 4


def test_deepspeeds_universal_checkpoints_resume_at_any_stage_and_world_size():
    """ds_to_universal's output of the 2-rank fixtures (tests/fixtures/deepspeed_universal), loaded
    with load_universal at other stages, restores DeepSpeed's exact state and continues as DeepSpeed's
    own run did; at 1 rank the state is exact (the recorded losses are of 2 ranks' batches)."""
    universal = FIXTURES.parent / "deepspeed_universal"
    grid = [(1, 3, 2), (2, 0, 2), (3, 2, 2), (2, 1, 1), (3, 3, 1)]  # (DeepSpeed stage, shardwise stage, ranks)
    for ds_stage, into, world in grid:
        (ranks,) = run_distributed_cases(
            cases.import_deepspeed,
            [{"dir": str(universal / f"stage{ds_stage}"), "into_stage": into, "universal": True}],
            world_size=world,
            timeout=600,
        )
        for result in ranks:
            where = f"DeepSpeed stage {ds_stage} universal -> shardwise stage {into} on {world} ranks"
            assert all(result["checks"].values()), (where, result["checks"])
            assert result["global_steps"] == 4 and result["client_has_ds_config"], where
            if world == 2:  # DeepSpeed's recorded losses are of its 2 ranks' batches
                assert all(
                    math.isclose(a, b, rel_tol=1e-5) for a, b in zip(result["losses"], result["expected_losses"])
                ), (where, result["losses"], result["expected_losses"])
