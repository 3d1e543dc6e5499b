"""Whole tensor-parallel parameters for the length of a block (DeepSpeed's ``GatherReplacedLayerParams``).

Inside the block each given parameter that a :class:`~shardwise.tensor_parallel.layers.TensorParallelLayer`
of ``module`` splits holds the whole tensor (its ``.data`` is gathered over the layer's group); on exit it
holds this rank's slice again, cut from the whole tensor as it is then, so an edit made inside the block
on every rank is kept. Parameters no layer splits (a row-parallel bias, a norm weight) are left as they
are; a block given none of the split ones does nothing, as DeepSpeed's does. Use it to read a
tensor-parallel model's weights whole (exporting them to an inference server, OpenRLHF's weight sync).

Collective: every rank of each layer's tensor-parallel group must enter the block with the same parameters.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from shardwise.tensor_parallel.layers import ColumnParallelLinear, TPGroup
    >>> layer = ColumnParallelLinear(nn.Linear(2, 4), TPGroup(None, 0, 1))
    >>> with GatherReplacedLayerParams([layer.weight], layer):
    ...     layer.weight.shape
    torch.Size([4, 2])
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from shardwise.tensor_parallel.functions import gather_whole
from shardwise.tensor_parallel.layers import TensorParallelLayer, TPGroup
from shardwise.tensor_parallel.shards import Split

__all__ = ["GatherReplacedLayerParams", "split_parameters"]


def split_parameters(module: nn.Module) -> dict[int, tuple[Split, TPGroup]]:
    """Every parameter a tensor-parallel layer of ``module`` splits, by ``id``: its split and group."""
    found: dict[int, tuple[Split, TPGroup]] = {}
    for layer in module.modules():
        if isinstance(layer, TensorParallelLayer):
            for name, split in layer.splits.items():
                param = getattr(layer, name)
                if param is not None:
                    found[id(param)] = (split, layer.tp)
    return found


class GatherReplacedLayerParams:
    """Gather ``params`` (one tensor or several) of ``module``'s tensor-parallel layers for the block.

    Args:
        params: the parameters; those no tensor-parallel layer of ``module`` splits are left alone.
        module: the model (or an engine: its ``.module``) the parameters belong to.
        enabled: False makes the block do nothing.
    """

    def __init__(self, params: Iterable[torch.Tensor] | torch.Tensor, module: Any, enabled: bool = True) -> None:
        self.enabled = enabled
        self.module = module
        self.params: list[torch.Tensor] = [params] if isinstance(params, torch.Tensor) else list(params)
        model = module if isinstance(module, nn.Module) else getattr(module, "module", None)
        if enabled and not isinstance(model, nn.Module):
            raise TypeError(
                f"GatherReplacedLayerParams(module={type(module).__name__}): expected the model (an nn.Module) "
                "or an engine holding it as .module"
            )
        splits = split_parameters(model) if enabled and model is not None else {}
        seen: set[int] = set()
        self._targets: list[tuple[torch.Tensor, Split, TPGroup]] = []
        for param in self.params:
            if id(param) in splits and id(param) not in seen:
                seen.add(id(param))
                self._targets.append((param, *splits[id(param)]))
        if not self._targets:
            self.enabled = False

    def __enter__(self) -> None:
        if not self.enabled:
            return
        with torch.no_grad():
            for param, split, tp in self._targets:
                param.data = gather_whole(param.data, split, tp).contiguous()

    def __exit__(self, *exc: object) -> None:
        if not self.enabled:
            return
        with torch.no_grad():
            for param, split, tp in self._targets:
                param.data = split.local(param.data, tp.rank).detach().clone()
