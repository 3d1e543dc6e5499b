"""Every access to FSDP2's and DTensor's internals, in one place.

Stage 3 shards with FSDP2 (``fully_shard``), whose parameters are DTensors. The public API
covers most of what the engine needs; what it does not (the local shard without an autograd
view, the units' parameter groups, the padded shard sizes, asynchronous unshard on CPU) is
read here and nowhere else, so a torch upgrade that moves one of them breaks one module
with a test (``tests/distributed/test_fsdp_internals.py``) that names it.

Every private access below names the torch version it was checked against
(:data:`CHECKED_AGAINST`); public ones say so.

Example:
    >>> import torch
    >>> from shardwise.comm.fsdp_internals import is_dtensor, local_tensor
    >>> t = torch.ones(2)
    >>> is_dtensor(t), local_tensor(t) is t
    (False, True)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardwise.comm.group_type import ProcessGroup

__all__ = [
    "CHECKED_AGAINST",
    "dtensor_group",
    "full_tensor",
    "is_dtensor",
    "is_fully_shard_class",
    "local_tensor",
    "set_unshard_async",
    "unit_padded_shard_numel",
    "unit_param_groups",
    "unit_shard_groups",
    "unit_sharded_params",
]

CHECKED_AGAINST = "2.13.0"
"""The torch version every private access in this module was read against (each access also
works on torch 2.11.0, checked; where 2.11 differs the access says so and detects it)."""

# fully_shard swaps a module's class for a dynamically made subclass defined in this module.
_FULLY_SHARD_MODULE = "torch.distributed.fsdp._fully_shard._fully_shard"  # private path, torch 2.13.0


# --------------------------------------------------------------------------------- DTensor
def is_dtensor(tensor: object) -> bool:
    """Whether ``tensor`` is a DTensor (FSDP2's sharded parameters and their optimizer state). Public API."""
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def local_tensor(tensor: Any) -> torch.Tensor:
    """A DTensor's local shard as the plain tensor it wraps (no autograd view), or ``tensor`` itself.

    Private: ``DTensor._local_tensor`` (torch 2.13.0). The public ``to_local()`` returns an
    autograd view whose ``grad_fn`` breaks once the shard is written in place.
    """
    return tensor._local_tensor if is_dtensor(tensor) else tensor


def full_tensor(tensor: Any) -> torch.Tensor:
    """The whole tensor: a DTensor's ``full_tensor()`` (a collective over its mesh), else ``tensor``. Public API."""
    return tensor.full_tensor() if is_dtensor(tensor) else tensor


def dtensor_group(tensor: Any) -> ProcessGroup:
    """The process group a 1-D DTensor is sharded over. Public API (``device_mesh.get_group()``)."""
    return tensor.device_mesh.get_group()


# ----------------------------------------------------------------------------------- FSDP2
def unit_param_groups(module: nn.Module) -> list[Any]:
    """The FSDP parameter groups (``FSDPParamGroup``) of one ``fully_shard`` unit, [] when it has none.

    Private: ``FSDPModule._get_fsdp_state()._fsdp_param_groups`` (a list, torch 2.13.0), or on
    older torch (2.11.0, checked) the single optional ``FSDPState._fsdp_param_group``. Detected by
    attribute, not by version string.
    """
    state = module._get_fsdp_state()  # type: ignore[operator]
    if hasattr(state, "_fsdp_param_groups"):
        return list(state._fsdp_param_groups)
    if hasattr(state, "_fsdp_param_group"):
        group = state._fsdp_param_group
        return [] if group is None else [group]
    raise RuntimeError(
        f"shardwise reads FSDP2's parameter groups from FSDPState._fsdp_param_groups (torch {CHECKED_AGAINST}) "
        f"or FSDPState._fsdp_param_group (torch 2.11.0); torch {torch.__version__} has neither. "
        "Fix: use torch 2.11 to 2.13, or update shardwise.comm.fsdp_internals for this torch."
    )


def unit_sharded_params(module: nn.Module) -> list[nn.Parameter]:
    """The sharded parameters FSDP2 manages directly in ``module`` (not in nested units).

    Private: ``FSDPParamGroup.fsdp_params`` and ``FSDPParam.sharded_param`` (torch 2.13.0).
    """
    return [fp.sharded_param for group in unit_param_groups(module) for fp in group.fsdp_params]


def unit_padded_shard_numel(module: nn.Module) -> list[int]:
    """Per parameter group of ``module``: the elements one rank contributes to its all-gather.

    Private: ``FSDPParam.padded_sharded_param_size`` (torch 2.13.0).
    """
    return [
        sum(p.padded_sharded_param_size.numel() for p in group.fsdp_params)
        for group in unit_param_groups(module)
    ]


def unit_shard_groups(module: nn.Module) -> list[ProcessGroup]:
    """The process group each of ``module``'s parameter groups gathers and reduces over.

    Private: ``FSDPParamGroup.mesh_info.shard_process_group`` (torch 2.13.0).
    """
    return [group.mesh_info.shard_process_group for group in unit_param_groups(module)]


def set_unshard_async(module: nn.Module) -> None:
    """Issue ``module``'s all-gathers asynchronously (CPU/gloo has no streams to overlap them).

    Private: ``FSDPModule._set_unshard_async_op`` (torch 2.13.0).
    """
    module._set_unshard_async_op(True)  # type: ignore[operator]


def is_fully_shard_class(cls: type) -> bool:
    """Whether ``cls`` is one of the classes ``fully_shard`` makes (``FSDP<user class>``).

    Private: the defining module's path, ``torch.distributed.fsdp._fully_shard._fully_shard``
    (torch 2.13.0), or the ``FSDP`` name prefix.
    """
    return cls.__name__.startswith("FSDP") or cls.__module__ == _FULLY_SHARD_MODULE
