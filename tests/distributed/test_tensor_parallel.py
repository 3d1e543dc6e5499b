"""Tensor parallelism on gloo ranks: the layers equal whole ones, and a tiny Llama trains at TP=2
with the losses of TP=1 (fp32, 20 steps) at ZeRO stages 0-2, holding half the split weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tp_cases import (
    batches,
    different_batches_are_refused,
    layers_match_whole_ones,
    llama_losses,
    resume_at_other_degree,
    tiny_llama,
)

from shardwise.checkpoint import dcp_io
from shardwise.checkpoint.export import load_full_state_dict
from shardwise.testing import run_distributed, run_distributed_cases

pytestmark = [pytest.mark.distributed]

STEPS = 20
# fp32 parity bound: the row-parallel layers sum two partial products instead of one dot product,
# a reordering of the same additions (relative error ~1e-7 per layer); SGD with momentum carries
# such differences linearly, so 20 steps keep the losses within 1e-6 of each other.
TOLERANCE = 1e-6


def test_split_layers_equal_whole_ones_forward_and_backward() -> None:
    for errors in run_distributed(layers_match_whole_ones, 2, args=({},), timeout=300):
        assert max(errors.values()) < 1e-6, errors


def test_the_tp_ranks_must_get_the_same_batch() -> None:
    for result in run_distributed(different_batches_are_refused, 2, args=({},), timeout=300):
        assert result["refused"] is not None and "Data inconsistency within the TP group" in result["refused"]
        assert len(result["same"]) == 1


def test_tp2_trains_like_tp1_at_stages_0_1_2_with_half_the_split_weights() -> None:
    cases = [{"tp": tp, "stage": stage, "steps": STEPS} for stage in (0, 1, 2) for tp in (1, 2)]
    results = run_distributed_cases(llama_losses, cases, timeout=900)
    for stage in (0, 1, 2):
        one, two = (results[cases.index({"tp": tp, "stage": stage, "steps": STEPS})] for tp in (1, 2))
        assert [r["tp"] for r in two] == [2, 2] and [r["dp"] for r in two] == [1, 1]
        assert [r["tp"] for r in one] == [1, 1] and [r["dp"] for r in one] == [2, 2]
        assert two[0]["kinds"] == ["ColumnParallelLinear", "RowParallelLinear"]
        reference = one[0]["losses"]
        assert reference[-1] < reference[0] - 0.1  # it learns
        for ranks in (one, two):
            for result in ranks:
                gap = max(abs(a - b) for a, b in zip(result["losses"], reference))
                assert gap < TOLERANCE, (stage, gap)
        assert two[0]["bytes"] * 2 == one[0]["bytes"] and two[1]["bytes"] * 2 == one[1]["bytes"]


@pytest.mark.slow
def test_zero3_with_tp_on_a_2x2_mesh_trains_like_tp1() -> None:
    """4 ranks: dp_shard=2 x tp=2 (FSDP2 shards each rank's slices over its data-parallel pair)
    against dp=4 at TP=1; the same tokens on every rank, so both see the same gradient."""
    cases = [{"tp": tp, "stage": 3, "steps": STEPS} for tp in (1, 2)]
    one, two = run_distributed_cases(llama_losses, cases, world_size=4, timeout=900)
    assert [r["tp"] for r in two] == [2] * 4 and [r["dp"] for r in two] == [2] * 4
    reference = one[0]["losses"]
    assert reference[-1] < reference[0] - 0.1
    for result in [*one, *two]:
        gap = max(abs(a - b) for a, b in zip(result["losses"], reference))
        assert gap < TOLERANCE, gap
    # a 2-D layout: each rank holds a quarter of every split weight (half by TP, half of that by
    # FSDP2 over its data-parallel pair), as many bytes as a rank of the 4-way FSDP2 run
    whole = sum(r["bytes"] for r in one)
    assert whole == 73728 and [r["bytes"] for r in two] == [whole // 4] * 4


def test_a_tp2_checkpoint_holds_whole_tensors_and_resumes_at_tp1_and_back(tmp_path: Path) -> None:
    """Saved at TP=2 (dp=1), loaded at TP=1 (dp=2), and the reverse: the next two steps' losses (the
    first from the loaded weights, the second after a step from the loaded momentum) are the
    saving run's, within the parity bound."""
    cases = [{"save_tp": a, "load_tp": b, "stage": stage, "dir": str(tmp_path / f"{a}{b}{stage}")}
             for stage in (0, 1, 3) for a, b in ((2, 1), (1, 2))]
    run_results = run_distributed_cases(resume_at_other_degree, cases, timeout=900)
    for case, ranks in zip(cases, run_results):
        for result in ranks:
            gap = max(abs(a - b) for a, b in zip(result["continued"], result["resumed"]))
            assert gap < TOLERANCE, (case, result)
    saved = dcp_io.saved_entries(dcp_io.read_metadata(tmp_path / "210" / "t"))
    assert saved["model/model.layers.0.self_attn.q_proj.weight"].shape == (32, 32)  # whole, one tensor
    assert saved["model/model.layers.0.self_attn.k_proj.weight"].shape == (16, 32)
    assert saved["optim/model.layers.1.mlp.down_proj.weight/momentum_buffer"].shape == (32, 64)
    assert not any(key.startswith("mp") for key in saved)
    # the export is one ordinary state dict: a plain model loads it and computes the saving run's next loss
    plain = tiny_llama()
    plain.load_state_dict(load_full_state_dict(tmp_path / "210", tag="t"))
    tokens = batches(8)[6]
    with torch.no_grad():
        loss = plain(input_ids=tokens, labels=tokens).loss.item()
    continued = run_results[cases.index(next(c for c in cases if c["dir"].endswith("210")))][0]["continued"][0]
    assert abs(loss - continued) < TOLERANCE
