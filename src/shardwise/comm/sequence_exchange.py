"""Differentiable collectives for sequence parallelism (Ulysses, ALST).

Ulysses shards a sequence across the ranks of the sequence-parallel group and, around
attention, trades the sequence shard for a head shard: one all-to-all scatters the heads and
gathers the sequence, a second one after attention undoes it. An all-to-all is a permutation of
the group's data, so its gradient is the inverse all-to-all (scatter and gather swapped). This
module owns those exchanges and the other autograd-aware collectives the sequence package needs;
:mod:`shardwise.sequence` calls them and never ``torch.distributed`` itself.

* :func:`all_to_all_dims` -- split ``x`` along ``scatter_dim`` (sizes may differ per rank: an
  uneven head count), send piece ``j`` to rank ``j``, concatenate what arrives along
  ``gather_dim``. Differentiable: backward is the same exchange with the dimensions swapped.
* :func:`all_gather_cat` -- every rank's tensor concatenated along a dimension
  (differentiable: backward sums the incoming gradients over the group and keeps this rank's
  slice, because every rank used every slice).
* :func:`all_gather_sizes`, :func:`all_reduce_sum` -- the plain, non-differentiable helpers the
  data loader adapter and the loss use (and :func:`all_gather_objects`, from
  :mod:`shardwise.comm.object_gather`, importable from here).

The group must not be None for a group smaller than the world; a group of one rank is an
identity (no collective is made).

Example:
    >>> import torch
    >>> from shardwise.comm.sequence_exchange import all_to_all_dims
    >>> x = torch.arange(6.0).view(1, 3, 2)
    >>> torch.equal(all_to_all_dims(x, scatter_dim=2, gather_dim=1, group=None, world_size=1), x)
    True
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from shardwise.comm.group_type import Group
from shardwise.comm.object_gather import all_gather_objects

__all__ = [
    "all_gather_cat",
    "all_gather_objects",
    "all_gather_sizes",
    "all_reduce_sum",
    "all_to_all_dims",
    "group_rank",
    "group_size",
]


def group_size(group: Group) -> int:
    """Ranks in ``group`` (1 without a process group)."""
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def group_rank(group: Group) -> int:
    """This rank's place in ``group`` (0 without a process group)."""
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def _even_sizes(total: int, parts: int, what: str) -> list[int]:
    if total % parts:
        raise ValueError(
            f"all_to_all_dims: {what} has size {total}, not divisible by the group size {parts}; "
            "pass explicit sizes for an uneven split"
        )
    return [total // parts] * parts


def _exchange(
    x: torch.Tensor,
    scatter_dim: int,
    gather_dim: int,
    group: Group,
    scatter_sizes: list[int],
    gather_sizes: list[int],
) -> torch.Tensor:
    world, rank = len(scatter_sizes), group_rank(group)
    pieces = [p.contiguous() for p in torch.split(x, scatter_sizes, dim=scatter_dim)]
    send = torch.cat([p.reshape(-1) for p in pieces])
    shapes = []
    for source in range(world):
        shape = list(x.shape)
        shape[scatter_dim], shape[gather_dim] = scatter_sizes[rank], gather_sizes[source]
        shapes.append(shape)
    out_sizes = [int(torch.Size(s).numel()) for s in shapes]
    received = torch.empty(sum(out_sizes), dtype=x.dtype, device=x.device)
    dist.all_to_all_single(
        received,
        send,
        output_split_sizes=out_sizes,
        input_split_sizes=[p.numel() for p in pieces],
        group=group,
    )
    parts = [chunk.view(shape) for chunk, shape in zip(torch.split(received, out_sizes), shapes, strict=True)]
    return torch.cat(parts, dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    """The exchange with its inverse as the gradient."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        scatter_dim: int,
        gather_dim: int,
        group: Group,
        scatter_sizes: list[int],
        gather_sizes: list[int],
    ) -> torch.Tensor:
        ctx.args = (gather_dim, scatter_dim, group, gather_sizes, scatter_sizes)
        return _exchange(x, scatter_dim, gather_dim, group, scatter_sizes, gather_sizes)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (_AllToAll.apply(grad.contiguous(), *ctx.args), None, None, None, None, None)


def all_to_all_dims(
    x: torch.Tensor,
    scatter_dim: int,
    gather_dim: int,
    group: Group,
    scatter_sizes: Sequence[int] | None = None,
    gather_sizes: Sequence[int] | None = None,
    world_size: int | None = None,
) -> torch.Tensor:
    """Scatter ``x`` along ``scatter_dim`` over ``group`` and gather along ``gather_dim``.

    Args:
        x: the local tensor.
        scatter_dim: the dimension split into one piece per rank (piece ``j`` goes to rank ``j``).
        gather_dim: the dimension the received pieces are concatenated along, in rank order.
        group: the process group (None: the world).
        scatter_sizes: the size of each rank's piece of ``scatter_dim`` (default: even).
        gather_sizes: each rank's size of ``gather_dim`` (default: all equal to this rank's).
        world_size: the group's size when already known (saves a query).

    Returns:
        A tensor whose ``scatter_dim`` is this rank's piece and whose ``gather_dim`` holds every
        rank's. Autograd flows through it (the backward is the inverse exchange).
    """
    world = group_size(group) if world_size is None else world_size
    if world == 1:
        return x
    if scatter_dim == gather_dim:
        raise ValueError(
            f"all_to_all_dims: scatter_dim and gather_dim are both {scatter_dim}; they must differ"
        )
    scatter_dim, gather_dim = scatter_dim % x.dim(), gather_dim % x.dim()
    ssizes = (
        list(scatter_sizes)
        if scatter_sizes is not None
        else _even_sizes(x.shape[scatter_dim], world, "scatter_dim")
    )
    gsizes = list(gather_sizes) if gather_sizes is not None else [x.shape[gather_dim]] * world
    if len(ssizes) != world or sum(ssizes) != x.shape[scatter_dim]:
        raise ValueError(
            f"all_to_all_dims: scatter sizes {ssizes} must be {world} sizes summing to {x.shape[scatter_dim]}"
        )
    return _AllToAll.apply(x, scatter_dim, gather_dim, group, ssizes, gsizes)


class _AllGatherCat(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Group, sizes: list[int]) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.sizes = dim, group, sizes
        buffers = []
        for size in sizes:
            shape = list(x.shape)
            shape[dim] = size
            buffers.append(torch.empty(shape, dtype=x.dtype, device=x.device))
        dist.all_gather(buffers, x.contiguous(), group=group)
        return torch.cat(buffers, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad = grad.clone(memory_format=torch.contiguous_format)  # reduced in place: never autograd's buffer
        dist.all_reduce(grad, group=ctx.group)
        mine = torch.split(grad, ctx.sizes, dim=ctx.dim)[group_rank(ctx.group)]
        return mine.contiguous(), None, None, None


def all_gather_cat(
    x: torch.Tensor, dim: int, group: Group, sizes: Sequence[int] | None = None
) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` in rank order (differentiable).

    The gradient of rank ``r``'s slice is the sum of the gradients every rank computed for it
    (each used the whole result), which is how a loss computed identically on every rank from
    gathered per-rank terms gives each rank the gradient of its own terms times the group size.

    Args:
        x: this rank's tensor.
        dim: the concatenation dimension.
        group: the process group (None: the world).
        sizes: each rank's size along ``dim`` (default: all equal to this rank's).
    """
    world = group_size(group)
    if world == 1:
        return x
    dim = dim % x.dim() if x.dim() else 0
    if x.dim() == 0:
        x = x.reshape(1)
    sizes = list(sizes) if sizes is not None else [x.shape[dim]] * world
    return _AllGatherCat.apply(x, dim, group, sizes)


def all_gather_sizes(value: int, group: Group, device: torch.device | str = "cpu") -> list[int]:
    """Every rank's integer ``value`` (a sequence length, a token count), in rank order."""
    world = group_size(group)
    if world == 1:
        return [int(value)]
    mine = torch.tensor([int(value)], dtype=torch.int64, device=device)
    every = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    return [int(t.item()) for t in every]


def all_reduce_sum(x: torch.Tensor, group: Group) -> torch.Tensor:
    """A new tensor holding the sum of ``x`` over ``group`` (not differentiable)."""
    out = x.detach().clone()
    if group_size(group) > 1:
        dist.all_reduce(out, group=group)
    return out
