"""Which Muon matrices each flat shard holds pieces of, for :class:`~shardwise.optim.muon.MuonWithAdamW`
at ZeRO stages 1-2.

Stages 1-2 step one flat shard per bucket. Muon orthogonalises whole matrices, so the optimizer
needs, for each shard of a group it trains with Muon, the bucket's size, the shard's range in it,
where each matrix of the bucket lies, and a collective that sums a bucket-sized tensor over the
data-parallel group (each rank contributes its shard, zeros elsewhere: the whole bucket, exactly).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from shardwise.comm import collectives
from shardwise.comm.group_type import Group
from shardwise.optim.muon import FlatMatrices
from shardwise.zero.flat_group import FlatGroup

__all__ = ["flat_matrices"]


def flat_matrices(
    groups: Sequence[FlatGroup], group_index: Sequence[int], param_groups: Sequence[dict[str, Any]], process_group: Group
) -> dict[int, FlatMatrices]:
    """``id(master) -> FlatMatrices`` for every shard of the flat groups whose user group has ``use_muon``."""

    def assemble(tensor: Any) -> None:
        collectives.all_reduce(tensor, op="sum", group=process_group)

    out: dict[int, FlatMatrices] = {}
    for flat, gi in zip(groups, group_index):
        if not param_groups[gi].get("use_muon"):
            continue
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
