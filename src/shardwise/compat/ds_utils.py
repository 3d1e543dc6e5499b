"""``deepspeed.utils`` / ``deepspeed.checkpoint.utils`` / ``deepspeed.runtime.utils`` helpers clients call
(``deepspeed.utils.module_utils``' ``recursive_getattr``/``recursive_setattr`` too)."""

from __future__ import annotations

import os
from typing import Any

import torch

from shardwise.utils.logging import logger
from shardwise.utils.module_paths import recursive_getattr, recursive_setattr  # deepspeed.utils' names too

__all__ = [
    "clone_tensors_for_torch_save",
    "get_layer_ckpt_name_for_rank",
    "get_model_ckpt_name_for_rank",
    "get_zero_ckpt_name_for_rank",
    "logger",
    "move_to_device",
    "recursive_getattr",
    "recursive_setattr",
]


def clone_tensors_for_torch_save(item: object, device: torch.device | str = "cpu") -> Any:
    """A copy of ``item`` (nested dicts/lists/tuples of tensors) whose tensors are detached clones on
    ``device``, so ``torch.save`` writes only their own storage (not a view's whole flat buffer).

    Example:
        >>> flat = torch.arange(4.0); view = flat[:2]
        >>> clone_tensors_for_torch_save({"w": view})["w"].untyped_storage().nbytes()
        8
    """
    if torch.is_tensor(item):
        return item.detach().clone().to(device)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    if isinstance(item, (list, tuple)):
        return type(item)(clone_tensors_for_torch_save(v, device) for v in item)
    return item


def move_to_device(item: Any, device: torch.device | str, criterion_func: Any = torch.is_tensor) -> Any:
    """``item`` with every tensor (as ``criterion_func`` says) moved to ``device``, containers rebuilt."""
    if criterion_func(item):
        return item.to(device)
    if isinstance(item, dict):
        return {k: move_to_device(v, device, criterion_func) for k, v in item.items()}
    if isinstance(item, (list, tuple)):
        return type(item)(move_to_device(v, device, criterion_func) for v in item)
    return item


def get_model_ckpt_name_for_rank(base_folder: str, mp_rank_str: str) -> str:
    """A DeepSpeed checkpoint's model file for a model-parallel rank: ``<base>/mp_rank_<NN>_model_states.pt``."""
    return os.path.join(base_folder, f"mp_rank_{mp_rank_str}_model_states.pt")


def get_zero_ckpt_name_for_rank(base_folder: str, dp_rank: int, mp_rank: int) -> str:
    """A DeepSpeed checkpoint's ZeRO optimizer file: ``<base>/zero_pp_rank_<dp>_mp_rank_<NN>_optim_states.pt``."""
    return os.path.join(base_folder, f"zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt")


def get_layer_ckpt_name_for_rank(base_folder: str, layer_id: str, tp_rank: int) -> str:
    """A DeepSpeed pipeline checkpoint's layer file: ``<base>/layer_<id>-model_<NN>-model_states.pt``."""
    return os.path.join(base_folder, f"layer_{layer_id}-model_{tp_rank:02d}-model_states.pt")
