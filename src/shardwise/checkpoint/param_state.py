"""Checkpoint state of a torch optimizer that updates the module's own parameters.

ZeRO strategies describe their state themselves (``state_layout()``); anything else that
runs a torch optimizer directly on the module's parameters, plain tensors or FSDP2 DTensors,
is described here (:func:`param_layout`) and gets the checkpoint interface of
:class:`~shardwise.checkpoint.optimizer_state.OptimizerState` through
:class:`ParamOptimizerState`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from shardwise.checkpoint.optimizer_state import OptimizerState
from shardwise.comm.fsdp_internals import is_dtensor, local_tensor
from shardwise.zero.state_layout import Holding, ParamPlace, StateLayout


class ParamOptimizerState(OptimizerState):
    """The checkpoint interface for a torch optimizer over the module's (possibly DTensor) parameters.

    The optimizer may update the parameters themselves, or tensors that stand for them: the
    local shards of FSDP2 DTensor parameters, or fp32 masters of 16-bit parameters. ``param_of``
    maps ``id(optimizer tensor)`` to the parameter it stands for; local shards are then presented
    to DCP as DTensors with the parameter's placements, and separate masters are saved as
    ``master/<name>``.

    Args:
        optimizer: the torch optimizer.
        param_of: ``id(optimizer tensor) -> module parameter``; default: the tensors are the parameters.

    Example:
        >>> model = torch.nn.Linear(2, 2)
        >>> state = ParamOptimizerState(torch.optim.SGD(model.parameters(), lr=0.1))
        >>> names = {id(p): n for n, p in model.named_parameters()}
        >>> sorted(state.full_state_dict(names))
        ['master/bias', 'master/weight', 'optim/param_groups']
    """

    def __init__(self, optimizer: torch.optim.Optimizer, param_of: Mapping[int, Any] | None = None) -> None:
        super().__init__(param_layout(optimizer, param_of))


def param_layout(optimizer: torch.optim.Optimizer, param_of: Mapping[int, Any] | None = None) -> StateLayout:
    """The :class:`StateLayout` of a torch optimizer over the module's parameters (see
    :class:`ParamOptimizerState`): each optimizer tensor is a DTensor parameter's local shard,
    or a whole tensor; separate where it does not share the parameter's storage."""
    param_of = dict(param_of or {})
    places: list[ParamPlace] = []
    copies: list[tuple[torch.Tensor, object]] = []  # (separate master, its parameter)
    groups: list[tuple[int, ...]] = []
    for group in optimizer.param_groups:
        groups.append(tuple(range(len(places), len(places) + len(group["params"]))))
        for tensor in group["params"]:
            param = param_of.get(id(tensor), tensor)
            local = local_tensor(param)
            shard = is_dtensor(param) and not is_dtensor(tensor) and tuple(tensor.shape) == tuple(local.shape)
            separate = tensor is not param and (
                tensor.dtype != local.dtype
                or tensor.untyped_storage().data_ptr() != local.untyped_storage().data_ptr()
            )
            holding = Holding.LOCAL_SHARD if shard else Holding.WHOLE
            places.append(ParamPlace(param, tuple(param.shape), holding, separate, tensor=tensor))
            if separate:
                copies.append((tensor, param))

    def params_from_masters() -> None:
        with torch.no_grad():
            for master, param in copies:
                local_tensor(param).copy_(master)

    def masters_from_params() -> None:
        with torch.no_grad():
            for master, param in copies:
                master.copy_(local_tensor(param))

    return StateLayout(
        optimizer=optimizer,
        optimizer_name=type(optimizer).__name__,
        places=tuple(places),
        groups=tuple(groups),
        params_from_masters=params_from_masters,
        masters_from_params=masters_from_params,
        device=torch.device("cpu"),
    )
