"""The first forward's check that every tensor-parallel rank got the same batch.

Tensor-parallel ranks compute one model replica together, so they must see the same inputs; a
data loader over the world instead of the data-parallel ranks breaks that silently. As DeepSpeed
does, the engine checks the first forward's tensor inputs once: each is broadcast from the
group's first rank and compared; any difference on any rank fails on every rank.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from shardwise.comm import collectives
from shardwise.comm.init import group_source_rank
from shardwise.tensor_parallel.layers import TPGroup

__all__ = ["MISMATCH", "install_batch_check"]

MISMATCH = "Data inconsistency within the TP group. Please check the Dataloader implementation to ensure consistency."


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for key in sorted(value, key=str):
            yield from _tensors(value[key])


def inputs_differ(args: tuple[Any, ...], kwargs: dict[str, Any], tp: TPGroup) -> bool:
    """Whether any rank of ``tp`` holds tensor inputs different from the group's first rank (collective)."""
    source = group_source_rank(tp.group)
    differ = False
    for tensor in _tensors((args, kwargs)):
        theirs = tensor.detach().clone().contiguous()
        collectives.broadcast(theirs, src=source, group=tp.group)
        differ = differ or not torch.equal(theirs, tensor.detach())
    return collectives.all_reduce_max_flag(differ, group=tp.group)


def install_batch_check(module: nn.Module, tp: TPGroup) -> None:
    """Check the inputs of ``module``'s first forward across ``tp`` (then the hook removes itself).

    Raises (in that forward):
        AssertionError: the ranks' inputs differ (DeepSpeed's message).
    """
    if tp.size == 1:
        return

    def check(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        handle.remove()
        if inputs_differ(args, kwargs, tp):
            raise AssertionError(MISMATCH)

    handle = module.register_forward_pre_hook(check, prepend=True, with_kwargs=True)
