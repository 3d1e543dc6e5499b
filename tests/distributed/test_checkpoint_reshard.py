"""Save at 2 ranks, load at 1, 2 and 4 ranks across ZeRO stages 0-3, then train on.

Every load is checked twice: the full optimizer state right after the load must equal,
bit for bit, the state at save time (fp32 masters, exp_avg, exp_avg_sq, step), and the
next losses must follow the uninterrupted run. Losses are exact where the world size and
the stage are the same (and for stage 2 -> 1 at 2 ranks); otherwise they are compared at 1e-6
relative, because the arithmetic legitimately differs in the last bits:

* another world size splits the global batch differently, so per-rank means and the
  gradient sums round differently (measured up to 1.1e-7 relative over 4 steps);
* stage 0 updates whole parameters where stages 1-2 update flat shards and stage 3 the
  FSDP2 shards; same maths, but the elementwise kernels see different tensor boundaries
  and stage 3 reduces every micro step (measured 3e-8 relative).
"""

from __future__ import annotations

import math

import checkpoint_cases as cases
import pytest
import torch

from shardwise.checkpoint.export import export_checkpoint
from shardwise.checkpoint.writers import read_safetensors
from shardwise.testing import run_distributed_cases

pytestmark = pytest.mark.distributed
N = 4


def _close(a: list[float], b: list[float], rel: float) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=rel, abs_tol=0.0) for x, y in zip(a, b))


def _offloaded(stage: int, nvme: str) -> dict:
    where = {"device": "nvme", "nvme_path": nvme}
    zero = {"stage": stage, "reduce_bucket_size": 2000, "offload_optimizer": where, "offload_param": where}
    return {"zero_optimization": zero}


def _sharded3() -> dict:
    """Stage 3 with every parameter of the tiny model an FSDP2 DTensor shard (DeepSpeed's default
    persistence threshold would keep all of them unsharded)."""
    return {
        "zero_optimization": {"stage": 3, "reduce_bucket_size": 2000, "stage3_param_persistence_threshold": 0}
    }


def test_save_on_two_ranks_resumes_on_one_two_and_four_at_any_stage(tmp_path):
    a, b = str(tmp_path / "stage2_on_2"), str(tmp_path / "stage3_on_2")
    c = str(tmp_path / "sharded3_on_2")
    on_two = run_distributed_cases(
        cases.load_and_train_or_save,
        [
            {"op": "save", "stage": 2, "dir": a, "n": N},
            {"op": "load", "stage": 2, "dir": a, "n": N},
            {"op": "load", "stage": 1, "dir": a, "n": N},
            {"op": "load", "stage": 0, "dir": a, "n": N},
            {"op": "load", "stage": 3, "dir": a, "n": N},
            {"op": "save", "stage": 3, "dir": b, "n": N},
            {"op": "load", "stage": 3, "dir": b, "n": N},
            {"op": "load", "stage": 3, "dir": a, "n": N, "extra": _offloaded(3, str(tmp_path / "nvme"))},
            {"op": "load", "stage": 3, "dir": a, "n": N, "extra": _sharded3()},
            {"op": "save", "stage": 3, "dir": c, "n": N, "extra": _sharded3()},
            {"op": "load", "stage": 3, "dir": c, "n": N, "extra": _sharded3()},
            {"op": "load", "stage": 2, "dir": c, "n": N},
        ],
        world_size=2,
        timeout=600,
    )
    reference = on_two[0][0]["reference"]
    same, stage1, stage0, stage3, saved3, same3, offloaded3 = (r[0] for r in on_two[1:8])
    flat_to_shards, saved_shards, shards_to_shards, shards_to_flat = (r[0] for r in on_two[8:])
    for result in (same, stage1, stage0, stage3, same3, offloaded3):
        assert result["state_equal"] and result["global_steps"] == 2 * N
    # FSDP2 DTensor shards: flat shards -> DTensor shards, and back, and DTensor -> DTensor
    for result in (flat_to_shards, shards_to_shards, shards_to_flat):
        assert result["state_equal"] and result["global_steps"] == 2 * N
    assert _close(flat_to_shards["losses"], reference, 1e-6)  # 2 -> sharded 3
    assert shards_to_shards["losses"] == saved_shards["reference"]  # same world and layout: exact
    assert _close(shards_to_flat["losses"], saved_shards["reference"], 1e-6)  # sharded 3 -> 2
    assert same["losses"] == reference  # same world size and stage: exact
    assert stage1["losses"] == reference  # stage 2 -> 1 on 2 ranks: also exact (same kernels, same sums)
    assert _close(stage0["losses"], reference, 1e-6)
    assert _close(stage3["losses"], reference, 1e-6)  # 2 -> 3
    assert offloaded3["losses"] == stage3["losses"]  # 2 -> 3 with parameters and state in swap files
    reference3 = saved3["reference"]
    assert same3["losses"] == reference3  # stage 3 -> 3, same world: exact

    on_one = run_distributed_cases(
        cases.load_and_train_or_save,
        [{"op": "load", "stage": 1, "dir": a, "n": N}, {"op": "load", "stage": 1, "dir": b, "n": N}],
        world_size=1,
        timeout=300,
    )
    on_four = run_distributed_cases(
        cases.load_and_train_or_save,
        [
            {"op": "load", "stage": 3, "dir": a, "n": N},
            {"op": "load", "stage": 2, "dir": b, "n": N},
            {"op": "load", "stage": 3, "dir": c, "n": N, "extra": _sharded3()},
        ],
        world_size=4,
        timeout=600,
    )
    two_to_one, three_to_one = on_one[0][0], on_one[1][0]
    two_to_four, three_to_four, shards_to_four = on_four[0][0], on_four[1][0], on_four[2][0]
    for result in (two_to_one, three_to_one, two_to_four, three_to_four, shards_to_four):
        assert result["state_equal"] and result["global_steps"] == 2 * N
    assert _close(shards_to_four["losses"], saved_shards["reference"], 1e-6)  # DTensor shards 2 -> 4 ranks
    assert _close(two_to_one["losses"], reference, 1e-6)
    assert _close(three_to_one["losses"], reference3, 1e-6)  # 3 -> 1
    assert _close(two_to_four["losses"], reference, 1e-6)  # 2 on 2 ranks -> 3 on 4
    assert _close(three_to_four["losses"], reference3, 1e-6)  # 3 on 2 ranks -> 2 on 4

    # export of the stage-3 checkpoint reproduces the model's full state dict, bit for bit
    exported = read_safetensors(export_checkpoint(b, tmp_path / "export", dtype=None))
    saved = saved3["saved_state"]
    assert list(exported) == list(saved)
    assert all(torch.equal(exported[k], v) for k, v in saved.items())
