"""Whole (unsharded) tensors into a module's state, at any ZeRO stage.

The module's own ``load_state_dict`` cannot take whole tensors for FSDP2's DTensor parameters
(stage 3); this copies each whole tensor into the module's tensor in place, keeping only this
rank's shard of a DTensor, so flat-buffer views (stages 0-2) and shards (stage 3) stay where
they are. Used by ``engine.load_module_state_dict`` and the DeepSpeed checkpoint import.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from shardwise.checkpoint.optimizer_state import copy_full_into
from shardwise.comm.fsdp_internals import is_dtensor, local_tensor


def copy_whole_state(
    module: nn.Module, state: Mapping[str, Any], *, strict: bool, source: str, fix: str
) -> None:
    """Copy ``state`` (whole tensors, or DTensors laid out like the module's) into ``module``'s state.

    Args:
        module: the (possibly FSDP2-sharded) module.
        state: ``name -> tensor`` as ``module.state_dict()`` names them.
        strict: raise when keys are missing or unexpected; else load the matching ones.
        source: what ``state`` is, for the error (``"the module state dict"``).
        fix: how to load the matching entries only, for the error.

    Raises:
        RuntimeError: ``strict`` and the keys differ (naming them), or a shape differs (naming the key).
    """
    targets = module.state_dict()
    missing = [k for k in targets if k not in state]
    unexpected = [k for k in state if k not in targets]
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"Error(s) in loading {source}: missing keys {missing}, unexpected keys {unexpected}. {fix}"
        )
    with torch.no_grad():
        for key, target in targets.items():
            if key not in state:
                continue
            value = state[key]
            if tuple(value.shape) != tuple(target.shape):
                raise RuntimeError(
                    f"Error(s) in loading {source}: {key!r} has shape {tuple(value.shape)} but the model's "
                    f"is {tuple(target.shape)}; load a state dict of the same model"
                )
            if is_dtensor(value):
                local_tensor(target).copy_(local_tensor(value))
            else:
                copy_full_into(target, value)
