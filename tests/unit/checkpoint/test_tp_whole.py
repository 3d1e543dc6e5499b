"""Tensor-parallel slices addressed as chunks of the whole tensor (no process group needed)."""

from __future__ import annotations

import torch
from torch import nn

from shardwise.checkpoint.dcp_io import FlatShards, SavedEntry
from shardwise.checkpoint.tp_whole import tp_slices
from shardwise.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, TPGroup


def _paint(shards: FlatShards, whole: torch.Tensor) -> None:
    """Write each box's region of ``whole`` through the box's view (what a DCP read does)."""
    for box, view in shards._boxes:
        region = tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))
        view.copy_(whole[region])


def test_each_ranks_boxes_tile_the_whole_tensor_for_packed_and_row_splits() -> None:
    torch.manual_seed(0)
    whole_qkv, whole_o = nn.Linear(4, 12), nn.Linear(6, 4)
    seen_qkv, seen_o = torch.zeros(12, 4), torch.zeros(4, 6)
    for rank in range(2):
        model = nn.Module()
        model.qkv = ColumnParallelLinear(whole_qkv, TPGroup(None, rank, 2), sub_sizes=(8, 2, 2))
        model.o = RowParallelLinear(whole_o, TPGroup(None, rank, 2))
        slices = tp_slices(model)
        assert set(slices.splits) == {"qkv.weight", "qkv.bias", "o.weight"}
        items = slices.whole_items({"model/qkv.weight": model.qkv.weight.detach(), "model/o.weight": model.o.weight.detach(),
                                    "model/o.bias": model.o.bias.detach(), "optim/qkv.weight/step": torch.tensor(3.0)})
        assert items["model/qkv.weight"].size() == (12, 4) and items["model/o.weight"].size() == (4, 6)
        assert isinstance(items["model/o.bias"], torch.Tensor) and items["optim/qkv.weight/step"].dim() == 0
        for box, view in items["model/qkv.weight"]._boxes:
            seen_qkv[box.offsets[0]:box.offsets[0] + box.sizes[0]] += view
        for box, view in items["model/o.weight"]._boxes:
            seen_o[:, box.offsets[1]:box.offsets[1] + box.sizes[1]] += view
        # loading: a target at the slice's shape is filled from the whole tensor, in place
        target = torch.zeros_like(model.qkv.weight)
        _paint(slices.whole("qkv.weight", target), whole_qkv.weight.detach())
        assert torch.equal(target, model.qkv.weight)
        local = slices.local_entries({"model/o.weight": SavedEntry((4, 6), torch.float32)})
        assert local["model/o.weight"].shape == (4, 3)
    assert torch.equal(seen_qkv, whole_qkv.weight) and torch.equal(seen_o, whole_o.weight)  # each element once


def test_flat_range_shards_of_a_slice_map_into_the_whole_tensor() -> None:
    whole = nn.Linear(5, 4, bias=False)
    layer = RowParallelLinear(whole, TPGroup(None, 1, 2))  # columns 3..4 of 5
    flat = layer.weight.detach().reshape(-1).clone()  # (4, 2) slice, flat
    shards = FlatShards((4, 2), torch.float32, [(1, 7, flat[1:7])])  # a ZeRO rank's flat range of it
    model = nn.Module()
    model.o = layer
    mapped = tp_slices(model).whole("o.weight", shards)
    painted = torch.zeros(5 * 4)
    for box, view in mapped._boxes:
        assert box.offsets[1] >= 3  # this rank's columns of the whole weight
        region = torch.zeros(4, 5)
        region[box.offsets[0]:box.offsets[0] + box.sizes[0], box.offsets[1]:box.offsets[1] + box.sizes[1]] = view
        painted += region.reshape(-1)
    expected = torch.zeros(4, 5)
    expected[:, 3:] = layer.weight.detach()
    expected[0, 3] = 0  # flat elements 0 and 7 of the slice are outside the range
    expected[3, 4] = 0
    assert torch.equal(painted.view(4, 5), expected)
