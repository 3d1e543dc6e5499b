"""``deepspeed.utils.zero_to_fp32``'s three helpers, on shardwise's export (any stage, any world size,
shardwise or DeepSpeed checkpoints): :mod:`shardwise.checkpoint.export`."""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from shardwise.checkpoint.export import export_checkpoint, load_full_state_dict
from shardwise.utils.logging import logger

__all__ = [
    "convert_zero_checkpoint_to_fp32_state_dict",
    "get_fp32_state_dict_from_zero_checkpoint",
    "get_model_state_files",
    "get_optim_files",
    "load_state_dict_from_zero_checkpoint",
]


def _refuse(what: str, value: object) -> None:
    if value:
        raise NotImplementedError(
            f"zero_to_fp32 {what}={value!r} is not supported by shardwise: `shardwise checkpoint export` streams "
            "one tensor at a time instead (and takes --exclude-frozen-parameters)"
        )


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
    lazy_mode: bool = False,
) -> dict[str, torch.Tensor]:
    """The full fp32 state dict of a checkpoint (its ``latest`` tag, or ``tag``), in memory."""
    _refuse("exclude_frozen_parameters", exclude_frozen_parameters)
    _refuse("lazy_mode", lazy_mode)
    return load_full_state_dict(checkpoint_dir, tag=tag, dtype="fp32")


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    max_shard_size: str = "5GB",
    safe_serialization: bool = False,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
) -> Path:
    """Write the fp32 weights into ``output_dir`` as one ``model.safetensors`` (``safe_serialization``)
    or ``pytorch_model.bin``, streamed tensor by tensor (one file: ``max_shard_size`` is not used).
    Returns the file."""
    output = Path(output_dir) / ("model.safetensors" if safe_serialization else "pytorch_model.bin")
    return export_checkpoint(
        checkpoint_dir,
        output,
        tag=tag,
        dtype="fp32",
        fmt="safetensors" if safe_serialization else "pt",
        exclude_frozen_parameters=exclude_frozen_parameters,
    )


def load_state_dict_from_zero_checkpoint(
    model: torch.nn.Module, checkpoint_dir: str | os.PathLike[str], tag: str | None = None
) -> torch.nn.Module:
    """Move ``model`` to the CPU and load the checkpoint's fp32 weights into it (not strict, as in DeepSpeed;
    missing and unexpected keys are logged by name); returns it."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=tag)
    model = model.cpu()
    result = model.load_state_dict(state, strict=False)
    if result.missing_keys or result.unexpected_keys:
        logger.warning(
            "load_state_dict_from_zero_checkpoint(%s): missing keys %s, unexpected keys %s",
            checkpoint_dir,
            result.missing_keys,
            result.unexpected_keys,
        )
    return model


def _natural_key(path: str) -> list[object]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path)]


def _files(checkpoint_dir: str | os.PathLike[str], pattern: str) -> list[str]:
    found = sorted((str(p) for p in Path(checkpoint_dir).glob(pattern)), key=_natural_key)
    if not found:
        raise FileNotFoundError(f"no file matching {pattern!r} in checkpoint directory '{checkpoint_dir}'")
    return found


def get_optim_files(checkpoint_dir: str | os.PathLike[str]) -> list[str]:
    """A DeepSpeed checkpoint tag directory's ``*_optim_states.pt`` files, in rank order (2 before 10)."""
    return _files(checkpoint_dir, "*_optim_states.pt")


def get_model_state_files(checkpoint_dir: str | os.PathLike[str]) -> list[str]:
    """A DeepSpeed checkpoint tag directory's ``*_model_states.pt`` files, in rank order."""
    return _files(checkpoint_dir, "*_model_states.pt")
