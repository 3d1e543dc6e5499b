"""Which Muon matrices each flat shard holds pieces of, for :class:`~shardwise.optim.muon.MuonWithAdamW`
at ZeRO stages 1-2.

Stages 1-2 step one flat shard per bucket. Muon orthogonalises whole matrices, so the optimizer
needs, for each shard of a group it trains with Muon, the bucket's size, the shard's range in it,
where each matrix of the bucket lies, and a collective that sums a bucket-sized tensor over the
data-parallel group (each rank contributes its shard, zeros elsewhere: the whole bucket, exactly).

With ``offload_optimizer`` the optimizer steps host copies of the shards (one per bucket shard,
in the same order on every rank, so the bucket sums still pair up across ranks): the map is keyed
by those copies, and the sum runs on the device the shards live on (a host tensor goes there and
back: NCCL sums device tensors only; on a CPU-only machine both are the CPU).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from shardwise.comm import collectives
from shardwise.comm.group_type import Group
from shardwise.optim.muon import FlatMatrices
from shardwise.zero.flat_group import FlatGroup
from shardwise.zero.offloaded_optimizer import OffloadedOptimizer

__all__ = ["attach_flat_matrices", "flat_matrices"]


def _summer(process_group: Group, device: torch.device) -> Callable[[torch.Tensor], None]:
    def assemble(tensor: torch.Tensor) -> None:
        if tensor.device == device:
            collectives.all_reduce(tensor, op="sum", group=process_group)
            return
        there = tensor.to(device)
        collectives.all_reduce(there, op="sum", group=process_group)
        tensor.copy_(there)

    return assemble


def flat_matrices(
    groups: Sequence[FlatGroup], group_index: Sequence[int], param_groups: Sequence[dict[str, Any]], process_group: Group
) -> dict[int, FlatMatrices]:
    """``id(master) -> FlatMatrices`` for every shard of the flat groups whose user group has ``use_muon``."""
    out: dict[int, FlatMatrices] = {}
    for flat, gi in zip(groups, group_index):
        if not param_groups[gi].get("use_muon"):
            continue
        assemble = _summer(process_group, flat.device)
        for b, plan in enumerate(flat.layout.buckets):
            lo, hi = flat.owned[b]
            matrices = tuple(
                (flat.layout.slots[i].offset - plan.start, tuple(flat.params[i].shape)) for i in plan.param_indices
            )
            out[id(flat.master[b])] = FlatMatrices(
                bucket_numel=plan.end - plan.start,
                own=(lo - plan.start, hi - plan.start),
                matrices=matrices,
                assemble=assemble,
            )
    return out


def attach_flat_matrices(
    optimizer: Any,
    groups: Sequence[FlatGroup],
    group_index: Sequence[int],
    param_groups: Sequence[dict[str, Any]],
    process_group: Group,
) -> None:
    """Tell an optimizer that steps flat shards whole-matrix-wise (one with ``attach_flat_matrices``,
    possibly behind optimizer offload) where its shards' matrices lie; others are left alone."""
    inner = optimizer.inner if isinstance(optimizer, OffloadedOptimizer) else optimizer
    attach = getattr(inner, "attach_flat_matrices", None)
    if attach is None:
        return
    shards = flat_matrices(groups, group_index, param_groups, process_group)
    if inner is not optimizer:  # the inner optimizer steps the store's host copies of the masters
        store = optimizer.store
        host_of = {id(d): h for d, h in zip(store.device_tensors, store.host)}
        shards = {id(host_of[key]): value for key, value in shards.items() if key in host_of}
    attach(shards)
