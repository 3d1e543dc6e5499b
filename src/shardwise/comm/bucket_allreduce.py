"""Averaging all-reduces over lists of tensors, and gathers of rows whose count differs per rank.

What DeepSpeed's engine offers as ``allreduce_bucket`` / ``allreduce_and_copy`` / ``allreduce_no_retain``
(one flat all-reduce per bucket of tensors, averaged as the config's ``prescale_gradients`` /
``gradient_predivide_factor`` / ``gradient_allreduce_op`` say, optionally in another dtype on the wire),
``all_gather_scalar`` and ``sparse_all_gather`` (an all-gather of a tensor whose first dimension differs
between ranks). The engine's methods of those names call these with its config and groups
(:mod:`shardwise.runtime.ds_engine_actions`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from shardwise.comm import collectives, torch_api
from shardwise.comm.group_type import Group
from shardwise.comm.init import get_world_size

__all__ = ["Averaging", "all_gather_rows", "all_gather_scalar", "allreduce_and_copy", "allreduce_bucket"]


@dataclass(frozen=True)
class Averaging:
    """How a summed bucket becomes a mean: ``op`` ``"mean"`` or ``"sum"`` (``gradient_allreduce_op``);
    ``prescale``: divide by the group size before the sum (``prescale_gradients``); else divide by
    ``predivide_factor`` before and multiply by ``predivide_factor / size`` after (``gradient_predivide_factor``);
    ``comm_dtype``: the dtype on the wire (None: the tensors' own)."""

    op: str = "mean"
    prescale: bool = False
    predivide_factor: float = 1.0
    comm_dtype: torch.dtype | None = None


def allreduce_bucket(
    bucket: Sequence[torch.Tensor], group: Group, averaging: Averaging, world_size: float | None = None
) -> torch.Tensor:
    """The tensors of ``bucket`` flattened into one tensor, summed over ``group`` and averaged over
    ``world_size`` (default: the group's size). Returns the flat result in the tensors' dtype.

    Example:
        >>> # allreduce_bucket([g1, g2], None, Averaging())  -> flat mean of [g1, g2] over the world
    """
    flat = _flatten_dense_tensors(list(bucket))
    wire = flat if averaging.comm_dtype in (None, flat.dtype) else flat.to(averaging.comm_dtype)
    size = float(get_world_size(group)) if world_size is None else float(world_size)
    if averaging.op == "sum":
        collectives.all_reduce(wire, op="sum", group=group)
    elif averaging.prescale:
        wire.mul_(1.0 / size)
        collectives.all_reduce(wire, op="sum", group=group)
    else:
        factor = averaging.predivide_factor
        if factor != 1.0:
            wire.mul_(1.0 / factor)
        collectives.all_reduce(wire, op="sum", group=group)
        if factor != size:
            wire.mul_(factor / size)
    if wire is not flat:
        flat.copy_(wire)
    return flat


def allreduce_and_copy(
    bucket: Sequence[torch.Tensor], group: Group, averaging: Averaging, world_size: float | None = None
) -> None:
    """:func:`allreduce_bucket`, then each tensor of ``bucket`` overwritten with its averaged values."""
    reduced = allreduce_bucket(bucket, group, averaging, world_size)
    for tensor, synced in zip(bucket, _unflatten_dense_tensors(reduced, list(bucket))):
        tensor.copy_(synced)


def all_gather_scalar(value: torch.Tensor, group: Group) -> list[torch.Tensor]:
    """Every rank's ``value`` (same shape on every rank), one tensor per rank of ``group``."""
    gathered = [torch.zeros_like(value) for _ in range(get_world_size(group))]
    torch_api.all_gather(gathered, value, group=group)
    return gathered


def all_gather_rows(value: torch.Tensor, group: Group) -> list[torch.Tensor]:
    """Every rank's ``value`` (1-D, or 2-D with the same row width), whose first dimension may differ
    between ranks: padded to the longest for the all-gather, each rank's rows cut back out.

    Raises:
        ValueError: ``value`` is not 1-D or 2-D.
    """
    if value.dim() not in (1, 2):
        raise ValueError(f"all_gather_rows gathers 1-D or 2-D tensors, got shape {tuple(value.shape)}")
    sizes = all_gather_scalar(torch.tensor([value.size(0)], dtype=torch.long, device=value.device), group)
    counts = [int(s[0]) for s in sizes]
    longest = max(counts)
    padded = value
    if value.size(0) < longest:
        padding = value.new_zeros((longest - value.size(0), *value.shape[1:]))
        padded = torch.cat([value, padding])
    gathered = [padded.new_empty(padded.shape) for _ in counts]
    torch_api.all_gather(gathered, padded.contiguous(), group=group)
    return [tensor[:count] for tensor, count in zip(gathered, counts)]
