"""``deepspeed.comm``'s remaining collectives, thin over ``torch.distributed`` with DeepSpeed's signatures.

shardwise's own collectives (:mod:`shardwise.comm.collectives`) pick algorithms and log to the
comms logger; these are the plain calls user scripts make through ``deepspeed.comm``
(``all_gather``, ``reduce``, ``reduce_scatter``, point-to-point, ``all_to_all_single``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwise.comm.group_type import Group

__all__ = [
    "all_gather",
    "all_to_all_single",
    "irecv",
    "isend",
    "recv",
    "reduce",
    "reduce_scatter",
    "send",
]


def all_gather(
    tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Group = None, async_op: bool = False
) -> dist.Work | None:
    """Every rank's ``tensor`` into ``tensor_list`` (one entry per rank)."""
    return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def reduce(
    tensor: torch.Tensor, dst: int, op: object = dist.ReduceOp.SUM, group: Group = None, async_op: bool = False
) -> dist.Work | None:
    """Reduce ``tensor`` over the group into rank ``dst``."""
    return dist.reduce(tensor, dst, op=op, group=group, async_op=async_op)


def reduce_scatter(
    output: torch.Tensor,
    input_list: list[torch.Tensor],
    op: object = dist.ReduceOp.SUM,
    group: Group = None,
    async_op: bool = False,
) -> dist.Work | None:
    """Reduce ``input_list`` over the group; rank ``r`` gets the reduced ``input_list[r]`` in ``output``."""
    return dist.reduce_scatter(output, input_list, op=op, group=group, async_op=async_op)


def all_to_all_single(
    output: torch.Tensor,
    tensor: torch.Tensor,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    group: Group = None,
    async_op: bool = False,
) -> dist.Work | None:
    """Split ``tensor`` over ranks and gather each rank's piece into ``output``."""
    return dist.all_to_all_single(
        output, tensor, output_split_sizes, input_split_sizes, group=group, async_op=async_op
    )


def send(tensor: torch.Tensor, dst: int, group: Group = None, tag: int = 0) -> None:
    """Blocking send to rank ``dst``."""
    dist.send(tensor, dst, group=group, tag=tag)


def recv(tensor: torch.Tensor, src: int | None = None, group: Group = None, tag: int = 0) -> int:
    """Blocking receive into ``tensor``; returns the sender's rank."""
    return dist.recv(tensor, src, group=group, tag=tag)


def isend(tensor: torch.Tensor, dst: int, group: Group = None, tag: int = 0) -> dist.Work | None:
    """Non-blocking send; returns the work handle."""
    return dist.isend(tensor, dst, group=group, tag=tag)


def irecv(
    tensor: torch.Tensor, src: int | None = None, group: Group = None, tag: int = 0
) -> dist.Work | None:
    """Non-blocking receive; returns the work handle."""
    return dist.irecv(tensor, src, group=group, tag=tag)
