"""The autograd pairs of tensor parallelism, communicating through :mod:`shardwise.comm`.

* :func:`copy_to_group`: identity forward, gradient summed over the group in backward (before a
  column-parallel layer: every rank's input gradient is a partial sum);
* :func:`reduce_from_group`: sum over the group forward, identity backward (after a row-parallel
  layer: every rank's output is a partial sum);
* :func:`gather_from_group`: the ranks' last-dimension slices concatenated forward (uneven
  slices padded for the collective), this rank's slice of the gradient backward.

Each takes the group and this rank's index in it; a group of one is the identity.
:func:`gather_whole` (no autograd) rebuilds a whole tensor from every rank's slice, for exports.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from shardwise.comm import collectives
from shardwise.comm.group_type import Group
from shardwise.comm.torch_api import all_gather
from shardwise.tensor_parallel.shards import Split

if TYPE_CHECKING:
    from shardwise.tensor_parallel.layers import TPGroup

__all__ = ["copy_to_group", "gather_from_group", "gather_whole", "reduce_from_group"]


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        collectives.all_reduce(grad, op="sum", group=ctx.group)
        return grad, None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        out = x.contiguous().clone()
        collectives.all_reduce(out, op="sum", group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, rank: int, sizes: tuple[int, ...]) -> torch.Tensor:
        ctx.rank, ctx.sizes = rank, sizes
        widest = max(sizes)
        padded = x.contiguous()
        if padded.shape[-1] < widest:
            padded = torch.nn.functional.pad(padded, (0, widest - padded.shape[-1]))
        pieces = [torch.empty_like(padded) for _ in sizes]
        all_gather(pieces, padded, group=group)
        return torch.cat([p[..., :size] for p, size in zip(pieces, sizes)], dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        start = sum(ctx.sizes[: ctx.rank])
        return grad.narrow(-1, start, ctx.sizes[ctx.rank]).contiguous(), None, None, None


def copy_to_group(x: torch.Tensor, group: Group, size: int) -> torch.Tensor:
    """Identity forward; the input gradient summed over ``group`` in backward."""
    return x if size == 1 else _CopyToGroup.apply(x, group)


def reduce_from_group(x: torch.Tensor, group: Group, size: int) -> torch.Tensor:
    """``x`` summed over ``group`` forward; identity backward."""
    return x if size == 1 else _ReduceFromGroup.apply(x, group)


def gather_from_group(x: torch.Tensor, group: Group, rank: int, sizes: tuple[int, ...]) -> torch.Tensor:
    """Every rank's last-dimension slice (widths ``sizes``) concatenated; backward keeps this rank's."""
    return x if len(sizes) == 1 else _GatherFromGroup.apply(x, group, rank, sizes)


def gather_whole(local: torch.Tensor, split: Split, tp: TPGroup) -> torch.Tensor:
    """The whole tensor from every rank's slice ``local`` (collective over ``tp``; no autograd).

    Slices of unequal sizes are padded along the split dimension for the collective.
    """
    if tp.size == 1:
        return local
    widest = max(split.local_size(r) for r in range(split.parts))
    padded = local.detach().contiguous()
    if padded.shape[split.dim] < widest:
        shape = list(padded.shape)
        shape[split.dim] = widest - padded.shape[split.dim]
        padded = torch.cat([padded, padded.new_zeros(shape)], dim=split.dim)
    pieces = [torch.empty_like(padded) for _ in range(tp.size)]
    all_gather(pieces, padded, group=tp.group)
    return split.whole([p.narrow(split.dim, 0, split.local_size(r)) for r, p in enumerate(pieces)])
