"""Checkpoint items of tensor-parallel slices addressed as chunks of the whole tensor.

A tensor-parallel layer (:mod:`shardwise.tensor_parallel`) holds only this rank's slice of a
weight. Saved as it is, a checkpoint would hold one tensor per tensor-parallel rank under the
same name and could only be loaded at the same degree. Instead every item of a split parameter
(``model/<name>``, ``master/<name>``, ``optim/<name>/<state>``) is presented to DCP as the boxes
it covers *of the whole tensor* (the slice's :class:`~shardwise.tensor_parallel.shards.Split`
says where they sit), so the files hold whole tensors, the topology-free format: a TP=2 run
resumes at TP=1 (or another data-parallel size) and an export is one ordinary state dict.

The same mapping turns load targets (this rank's slices, in any ZeRO layout: a plain tensor,
stage 1-2 flat ranges, stage 3 DTensor shards) into whole-tensor boxes that DCP fills in place.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from shardwise.autoep.layer import AutoEPMoELayer
from shardwise.checkpoint import keys
from shardwise.checkpoint.boxes import Box
from shardwise.checkpoint.dcp_io import FlatShards, SavedEntry
from shardwise.comm.fsdp_internals import is_dtensor, local_tensor
from shardwise.tensor_parallel.functions import gather_whole
from shardwise.tensor_parallel.layers import TensorParallelLayer, TPGroup
from shardwise.tensor_parallel.shards import Split

__all__ = ["TPSlices", "tp_slices"]


def _flat_start(shape: tuple[int, ...], offsets: tuple[int, ...]) -> int:
    start, stride = 0, 1
    for size, offset in zip(reversed(shape), reversed(offsets)):
        start += offset * stride
        stride *= size
    return start


def _local_boxes(value: Any) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """``(offsets, tensor)`` of each chunk of ``value`` in the coordinates of the local slice."""
    if isinstance(value, FlatShards):
        return [(box.offsets, tensor) for box, tensor in value._boxes]
    if is_dtensor(value):
        chunks = value.__create_chunk_list__()
        local = local_tensor(value)
        return [(tuple(chunks[0].offsets), local)] if chunks and local.numel() else []
    return [((0,) * value.dim(), value)]


class TPSlices:
    """Every split parameter of a model by name: its :class:`Split` and its tensor-parallel group."""

    def __init__(self, splits: Mapping[str, tuple[Split, TPGroup]], whole_shapes: Mapping[str, tuple[int, ...]]) -> None:
        self.splits = dict(splits)
        self.whole_shapes = dict(whole_shapes)

    def gathered(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """The whole tensor of split parameter ``name`` from this rank's whole slice ``value``
        (collective over its tensor-parallel group); other names unchanged."""
        if name not in self.splits:
            return value
        split, tp = self.splits[name]
        return gather_whole(value, split, tp)

    def __bool__(self) -> bool:
        return bool(self.splits)

    def param_of(self, key: str) -> str | None:
        """The split parameter an item key (``model/``, ``master/``, ``optim/<name>/``) belongs to."""
        for prefix in (keys.MODEL, keys.MASTER):
            if key.startswith(prefix) and key[len(prefix):] in self.splits:
                return key[len(prefix):]
        if key.startswith("optim/"):
            name = key[len("optim/"):].rsplit("/", 1)[0]
            return name if name in self.splits else None
        return None

    def localized(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """``state`` (a module state dict of whole tensors) with every split parameter's whole
        tensor cut to this rank's slice (anything else, or already a slice, unchanged)."""
        out = dict(state)
        for name, (split, tp) in self.splits.items():
            value = out.get(name)
            if isinstance(value, torch.Tensor) and tuple(value.shape) == self.whole_shapes[name]:
                out[name] = split.local(value, tp.rank)
        return out

    def whole(self, name: str, value: Any) -> Any:
        """``value`` (a tensor, flat-range shards or a DTensor shard at the slice's shape) as boxes of
        the whole tensor; anything not at the slice's shape (a scalar ``step``) unchanged."""
        split, tp = self.splits[name]
        rank = tp.rank
        whole_shape = self.whole_shapes[name]
        local_shape = list(whole_shape)
        local_shape[split.dim] = split.local_size(rank)
        shape = tuple(value.size()) if isinstance(value, FlatShards) or is_dtensor(value) else (
            tuple(value.shape) if isinstance(value, torch.Tensor) else None)
        if shape != tuple(local_shape):
            return value
        dtype = value.dtype
        runs = self._runs(split, rank)
        boxes: list[tuple[Box, torch.Tensor]] = []
        for offsets, tensor in _local_boxes(value):
            lo, size = offsets[split.dim], tensor.shape[split.dim]
            for local_start, whole_start, length in runs:
                a, b = max(lo, local_start), min(lo + size, local_start + length)
                if a >= b:
                    continue
                new_offsets = list(offsets)
                new_offsets[split.dim] = whole_start + (a - local_start)
                part = tensor.narrow(split.dim, a - lo, b - a)
                boxes.append((Box(tuple(new_offsets), tuple(part.shape), _flat_start(whole_shape, tuple(new_offsets))),
                              part))
        out = FlatShards.__new__(FlatShards)
        out.shape, out.dtype, out._boxes = torch.Size(whole_shape), dtype, boxes
        return out

    @staticmethod
    def _runs(split: Split, rank: int) -> list[tuple[int, int, int]]:
        """``(local start, whole start, length)`` of each packed piece this rank holds."""
        runs, local, whole = [], 0, 0
        for index, size in enumerate(split.rank_sizes[rank]):
            before = sum(split.rank_sizes[r][index] for r in range(rank))
            total = sum(split.rank_sizes[r][index] for r in range(split.parts))
            runs.append((local, whole + before, size))
            local += size
            whole += total
        return runs

    def whole_items(self, items: dict[str, Any], prefix: str = "") -> dict[str, Any]:
        """``items`` with every split parameter's tensors addressed in the whole tensor."""
        out = {}
        for key, value in items.items():
            name = self.param_of(key[len(prefix):]) if key.startswith(prefix) else None
            out[key] = self.whole(name, value) if name is not None else value
        return out

    def local_entries(self, saved: Mapping[str, SavedEntry]) -> dict[str, SavedEntry]:
        """Saved entries of split parameters at this rank's slice shape (what the optimizer and the
        module expect; :meth:`whole_items` then addresses their targets in the whole tensor)."""
        out = dict(saved)
        for key, entry in saved.items():
            name = self.param_of(key)
            if name is None or entry.shape is None or tuple(entry.shape) != self.whole_shapes[name]:
                continue
            split, tp = self.splits[name]
            shape = list(entry.shape)
            shape[split.dim] = split.local_size(tp.rank)
            out[key] = SavedEntry(tuple(shape), entry.dtype)
        return out


def _autoep_slices(module: nn.Module, splits: dict[str, tuple[Split, TPGroup]],
                   shapes: dict[str, tuple[int, ...]]) -> None:
    """AutoEP layers' expert weights: rank ``r`` of the expert-parallel group holds experts
    ``r * L .. r * L + L - 1``, a cut of dimension 0 of the whole ``[num_experts, ...]`` tensor."""
    for prefix, layer in module.named_modules():
        if not isinstance(layer, AutoEPMoELayer) or layer.ep_size == 1:
            continue
        group = TPGroup(layer.ep_group, layer.ep_rank, layer.ep_size)
        for pname in ("w1", "w2", "w3"):
            name = f"{prefix}.experts.{pname}" if prefix else f"experts.{pname}"
            shape = list(getattr(layer.experts, pname).shape)
            shape[0] = layer.num_experts
            splits[name] = (Split.plan(dim=0, total=layer.num_experts, parts=layer.ep_size), group)
            shapes[name] = tuple(shape)


def tp_slices(module: nn.Module) -> TPSlices:
    """The split parameters of ``module``'s tensor-parallel layers and of its AutoEP layers'
    experts (empty without any)."""
    splits: dict[str, tuple[Split, TPGroup]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    _autoep_slices(module, splits, shapes)
    for prefix, layer in module.named_modules():
        if not isinstance(layer, TensorParallelLayer):
            continue
        for pname, split in layer.splits.items():
            name = f"{prefix}.{pname}" if prefix else pname
            param = getattr(layer, pname)
            shape = list(param.shape)
            if len(shape) <= split.dim:
                continue
            shape[split.dim] = split.total
            splits[name] = (split, layer.tp)
            shapes[name] = tuple(shape)
            assert math.prod(shape) > 0
    return TPSlices(splits, shapes)
