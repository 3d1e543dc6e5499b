"""DeepSpeed's ``deepspeed.moe.utils``: telling expert parameters apart and giving them their own
optimizer groups (ZeRO reduces an expert group's gradients over the expert-data-parallel group)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

DEFAULT_MAX_GROUP_SIZE = 178956971  # DeepSpeed's default cap on the elements of one expert group


def is_moe_param(param: torch.Tensor) -> bool:
    """Whether ``param`` is an expert parameter (``Experts`` marks them ``allreduce = False``)."""
    return getattr(param, "allreduce", True) is False


def has_moe_layers(module: nn.Module) -> tuple[bool, int]:
    """``(True, num_experts of the first MoE layer)`` when ``module`` holds one, else ``(False, 0)``."""
    from shardwise.moe.layer import MoE

    for sub in module.modules():
        if isinstance(sub, MoE):
            return True, sub.num_experts
    return False, 0


def split_params_into_shared_and_expert_params(
    params: Sequence[nn.Parameter],
) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """``(shared, expert)`` parameters."""
    shared = [p for p in params if not is_moe_param(p)]
    return shared, [p for p in params if is_moe_param(p)]


def split_params_grads_into_shared_and_expert_params(
    group: Sequence[nn.Parameter],
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``(shared, expert)`` gradients (in each parameter's dtype) of the parameters that have one."""
    shared: list[torch.Tensor] = []
    expert: list[torch.Tensor] = []
    for p in group:
        if p.grad is not None:
            (expert if is_moe_param(p) else shared).append(p.grad.to(p.dtype))
    return shared, expert


def split_params_into_different_moe_groups_for_optimizer(
    param_groups: dict[str, Any] | Sequence[dict[str, Any]],
    max_group_size: int | float | None = DEFAULT_MAX_GROUP_SIZE,
) -> list[dict[str, Any]]:
    """The optimizer groups with expert parameters moved out: each input group keeps its dense
    parameters, and for each expert-parallel group name one new group per input group follows
    (same hyperparameters, ``"name"`` the expert group's name, ``"moe": True``), cut into groups
    of at most ``max_group_size`` elements. Input groups are changed in place (as DeepSpeed does)."""
    if isinstance(param_groups, dict):
        groups = [param_groups]
    elif isinstance(param_groups, (list, tuple)):
        groups = list(param_groups)
    else:
        raise ValueError(
            f"split_params_into_different_moe_groups_for_optimizer: param_groups of type "
            f"{type(param_groups).__name__}; rule: a dict or a list/tuple of dicts; fix: pass the groups"
        )
    names: list[str] = []
    for group in groups:
        for p in group["params"]:
            if is_moe_param(p) and p.group_name not in names:
                names.append(p.group_name)
    added: list[dict[str, Any]] = []
    for group in groups:
        dense = [p for p in group["params"] if not is_moe_param(p)]
        for name in names:
            members = [p for p in group["params"] if is_moe_param(p) and p.group_name == name]
            for chunk in _cut(members, max_group_size):
                added.append({**group, "name": name, "moe": True, "params": chunk})
        group["params"] = dense
    return groups + added


def _cut(params: list[nn.Parameter], max_size: int | float | None) -> list[list[nn.Parameter]]:
    """``params`` in runs of at most ``max_size`` elements (one run when None; none when empty)."""
    if max_size is None:
        return [params]
    if not params:
        return []
    runs: list[list[nn.Parameter]] = [[]]
    size = 0
    for p in params:
        numel = int(getattr(p, "ds_numel", p.numel()))
        if runs[-1] and size + numel > max_size:
            runs.append([])
            size = 0
        runs[-1].append(p)
        size += numel
    return runs


def is_moe_param_group(param_group: dict[str, Any]) -> bool:
    """Whether an optimizer group holds expert parameters (``"moe": True``)."""
    return bool(param_group.get("moe", False))


def configure_moe_param_groups(model_parameters: list[Any]) -> list[dict[str, Any]]:
    """Optimizer groups for ``initialize(model_parameters=...)`` with expert groups split out
    (unless some group is already marked ``"moe"``)."""
    if not isinstance(model_parameters, list):
        raise TypeError("configure_moe_param_groups: model_parameters must be a list")
    for p in model_parameters:
        if not isinstance(p, (torch.Tensor, dict)):
            raise TypeError(
                f"configure_moe_param_groups: an entry of type {type(p).__name__}; rule: tensors or dicts"
            )
    if isinstance(model_parameters[0], torch.Tensor):
        return split_params_into_different_moe_groups_for_optimizer(
            {"params": model_parameters, "name": "dense-params"}
        )
    if any("moe" in group for group in model_parameters):
        return model_parameters
    return split_params_into_different_moe_groups_for_optimizer(model_parameters)
