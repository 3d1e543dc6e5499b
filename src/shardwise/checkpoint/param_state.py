"""Checkpoint state of an optimizer that updates the module's own parameters.

ZeRO stages 1-2 keep fp32 masters in flat shards and implement the checkpoint-state
methods themselves (:class:`shardwise.zero.sharded_optimizer.ZeroOptimizer`). Anything
else that runs a torch optimizer directly on the module's parameters, plain tensors or
FSDP2/ZeRO-3 DTensors, gets the same interface from :class:`ParamOptimizerState`:

==========================  ==================================================================
``sharded_state_dict``      ``optim/<name>/<key>`` (state tensors as they are: DTensor shards or
                            replicated tensors) and ``optim/param_groups``; the parameters
                            themselves are the fp32 values and are saved as ``model/<name>``
``sharded_load``            targets for a checkpoint of *any* layout, and a ``finish`` step
``full_state_dict``         every tensor whole on every rank (collective for DTensors)
``load_full_state_dict``    keep this rank's part of whole tensors
==========================  ==================================================================

A stage-3 engine plugs into the checkpoint format by exposing these five methods on its
optimizer (delegating to this class is enough when its parameters are the fp32 values).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

import torch

from shardwise.checkpoint.keys import PARAM_GROUPS as PARAM_GROUPS_KEY
from shardwise.checkpoint.keys import PARAM_NAMES as PARAM_NAMES_KEY


def _is_dtensor(tensor: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _local(tensor: Any) -> torch.Tensor:
    return tensor.to_local() if _is_dtensor(tensor) else tensor


class ParamOptimizerState:
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
        self.optimizer = optimizer
        self.param_of = dict(param_of or {})

    def _pairs(self) -> list[tuple[torch.Tensor, Any]]:
        """``(optimizer tensor, module parameter)`` in optimizer order."""
        return [
            (t, self.param_of.get(id(t), t)) for group in self.optimizer.param_groups for t in group["params"]
        ]

    def _name(self, names: Mapping[int, str], param: Any) -> str:
        name = names.get(id(param))
        if name is None:
            raise ValueError(
                f"the optimizer updates a tensor of shape {tuple(param.shape)} that is not a parameter of the "
                "module being checkpointed; checkpoints address parameters by module name"
            )
        return name

    def _groups(self, names: Mapping[int, str]) -> list[dict[str, Any]]:
        return [
            {
                **{k: v for k, v in group.items() if k != "params"},
                PARAM_NAMES_KEY: [self._name(names, self.param_of.get(id(t), t)) for t in group["params"]],
            }
            for group in self.optimizer.param_groups
        ]

    @staticmethod
    def _as_param(value: Any, param: Any) -> Any:
        """A local tensor with a DTensor parameter's local shape, presented like the parameter."""
        local_shaped = torch.is_tensor(value) and not _is_dtensor(value) and _is_dtensor(param)
        if local_shaped and tuple(value.shape) == tuple(param.to_local().shape):
            from torch.distributed.tensor import DTensor

            return DTensor.from_local(
                value,
                param.device_mesh,
                param.placements,
                run_check=False,
                shape=param.shape,
                stride=param.stride(),
            )
        return value

    @staticmethod
    def _separate(tensor: torch.Tensor, param: Any) -> bool:
        """Whether the optimizer's tensor is a copy (a master), not the parameter's own storage."""
        local = _local(param)
        return tensor is not param and (
            tensor.dtype != local.dtype
            or tensor.untyped_storage().data_ptr() != local.untyped_storage().data_ptr()
        )

    # ------------------------------------------------------------------ save
    def sharded_state_dict(self, names: Mapping[int, str]) -> dict[str, Any]:
        """State tensors as held (DCP writes DTensor shards and replicated tensors itself)."""
        out: dict[str, Any] = {}
        for tensor, param in self._pairs():
            name = self._name(names, param)
            if self._separate(tensor, param):
                out[f"master/{name}"] = self._as_param(tensor.detach(), param)
            for key, value in self.optimizer.state.get(tensor, {}).items():
                out[f"optim/{name}/{key}"] = self._as_param(value, param) if key != "step" else value
        out[PARAM_GROUPS_KEY] = self._groups(names)
        return out

    def full_state_dict(self, names: Mapping[int, str]) -> dict[str, Any]:
        """Whole tensors on every rank (DTensors are gathered: collective)."""
        out: dict[str, Any] = {}
        for tensor, param in self._pairs():
            name = self._name(names, param)
            out[f"master/{name}"] = _full(self._as_param(tensor.detach(), param)).float()
            for key, value in self.optimizer.state.get(tensor, {}).items():
                if torch.is_tensor(value) and key != "step":
                    value = _full(self._as_param(value, param))
                out[f"optim/{name}/{key}"] = value
        out[PARAM_GROUPS_KEY] = self._groups(names)
        return out

    # ------------------------------------------------------------------ load
    def sharded_load(
        self, names: Mapping[int, str], saved: Mapping[str, Any], *, with_state: bool
    ) -> tuple[dict[str, Any], Callable[[dict[str, Any]], None]]:
        """Targets in this layout for a checkpoint's keys (see ZeroOptimizer.sharded_load)."""
        targets: dict[str, Any] = {}
        allocated: dict[int, dict[str, Any]] = {}
        scalars: list[tuple[torch.Tensor, str, str]] = []
        separate: list[tuple[torch.Tensor, Any]] = []
        for tensor, param in self._pairs():
            name = self._name(names, param)
            targets[master_source(saved, name, tuple(param.shape))] = self._as_param(tensor.detach(), param)
            if self._separate(tensor, param):
                separate.append((tensor, param))
            if not with_state:
                continue
            prefix = f"optim/{name}/"
            for key in [k for k in saved if k.startswith(prefix)]:
                state_key, entry = key[len(prefix) :], saved[key]
                if entry.is_tensor and state_key != "step" and tuple(entry.shape) == tuple(param.shape):
                    buffer = torch.zeros_like(tensor.detach(), dtype=entry.dtype)
                    allocated.setdefault(id(tensor), {})[state_key] = buffer
                    targets[key] = self._as_param(buffer, param)
                else:
                    targets[key] = torch.empty(entry.shape, dtype=entry.dtype) if entry.is_tensor else None
                    scalars.append((tensor, state_key, key))
        if with_state and PARAM_GROUPS_KEY in saved:
            targets[PARAM_GROUPS_KEY] = None

        def finish(loaded: dict[str, Any]) -> None:
            with torch.no_grad():  # the parameters follow their freshly loaded masters
                for tensor, param in separate:
                    _local(param).copy_(tensor)
            if not with_state:
                return
            for tensor, state_key, key in scalars:
                value = loaded[key]
                allocated.setdefault(id(tensor), {})[state_key] = (
                    value.clone() if torch.is_tensor(value) else copy.deepcopy(value)
                )
            install_optimizer_state(self.optimizer, allocated, loaded.get(PARAM_GROUPS_KEY))

        return targets, finish

    def load_full_state_dict(
        self, state: Mapping[str, Any], names: Mapping[int, str], *, with_state: bool = True
    ) -> None:
        """Keep this rank's part of whole tensors (keys as :meth:`full_state_dict`)."""
        from shardwise.checkpoint.dcp_io import SavedEntry

        saved = {
            key: SavedEntry(tuple(v.shape), v.dtype) if torch.is_tensor(v) else SavedEntry(None, None)
            for key, v in state.items()
        }
        targets, finish = self.sharded_load(names, saved, with_state=with_state)
        with torch.no_grad():
            for key, target in targets.items():
                if torch.is_tensor(target):
                    _copy_full_into(target, state[key])
                else:
                    targets[key] = state[key]
        finish(targets)

    def refresh_masters_from_params(self) -> None:
        """Separate masters re-read the (just loaded) parameters; others are the parameters."""
        with torch.no_grad():
            for tensor, param in self._pairs():
                if self._separate(tensor, param):
                    tensor.copy_(_local(param))


def master_source(saved: Mapping[str, Any], name: str, shape: tuple[int, ...]) -> str:
    """The checkpoint key holding the fp32 value of trainable parameter ``name``, checked against ``shape``.

    ``master/<name>`` where the saving run kept separate fp32 masters (16-bit models), else
    ``model/<name>`` (its parameters were the fp32 values).

    Example:
        >>> from shardwise.checkpoint.dcp_io import SavedEntry
        >>> master_source({"model/w": SavedEntry((2, 3), torch.float32)}, "w", (2, 3))
        'model/w'
        >>> master_source({"model/w": SavedEntry((2, 3), torch.float32)}, "w", (3, 2))
        Traceback (most recent call last):
        ...
        ValueError: parameter 'w' has shape (3, 2) here but (2, 3) in the checkpoint
    """
    source = f"master/{name}" if f"master/{name}" in saved else f"model/{name}"
    entry = saved.get(source)
    if entry is None:
        raise ValueError(
            f"the checkpoint has no value for the trainable parameter {name!r} (neither master/ nor model/ entry); "
            "it was saved from a different model, or with exclude_frozen_parameters while this parameter was frozen"
        )
    if tuple(entry.shape) != tuple(shape):
        raise ValueError(
            f"parameter {name!r} has shape {tuple(shape)} here but {tuple(entry.shape)} in the checkpoint"
        )
    return source


def install_optimizer_state(
    optimizer: Any, per_tensor: Mapping[int, dict[str, Any]], saved_groups: list[dict[str, Any]] | None
) -> None:
    """Load assembled state into ``optimizer`` through its own ``load_state_dict``.

    ``per_tensor`` maps ``id(optimizer tensor)`` to that tensor's state; hyperparameters come
    from ``saved_groups`` (the checkpoint's param groups) where given. Going through
    ``load_state_dict`` lets the optimizer apply its own dtype/device rules (e.g. where
    ``step`` lives).
    """
    current = optimizer.param_groups
    if saved_groups is not None and len(saved_groups) != len(current):
        raise ValueError(
            f"the checkpoint's optimizer has {len(saved_groups)} param groups but this one has {len(current)}; "
            "build the same groups, or load with load_optimizer_states=False"
        )
    state: dict[int, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    index = 0
    for gi, group in enumerate(current):
        ids = []
        for tensor in group["params"]:
            if per_tensor.get(id(tensor)):
                state[index] = per_tensor[id(tensor)]
            ids.append(index)
            index += 1
        hyper = {k: v for k, v in group.items() if k != "params"}
        if saved_groups is not None:
            hyper.update({k: v for k, v in saved_groups[gi].items() if k not in ("params", PARAM_NAMES_KEY)})
        groups.append({**hyper, "params": ids})
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _full(tensor: Any) -> torch.Tensor:
    return tensor.full_tensor() if _is_dtensor(tensor) else tensor


def _copy_full_into(target: Any, full: torch.Tensor) -> None:
    """Copy a whole tensor into ``target``: its local shard if it is a DTensor."""
    if _is_dtensor(target):
        from torch.distributed.tensor import distribute_tensor

        local = distribute_tensor(
            full.to(target.device_mesh.device_type), target.device_mesh, target.placements, src_data_rank=None
        ).to_local()
        target.to_local().copy_(local)
    else:
        target.copy_(full)
