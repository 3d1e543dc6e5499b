"""Optimizers by ``ds_config.json`` name, our multi-tensor Lamb/Lion, and global-norm clipping maths.

Example:
    >>> import torch
    >>> from shardwise.optim import build_optimizer
    >>> model = torch.nn.Linear(4, 2)
    >>> opt = build_optimizer("Lamb", {"lr": 2e-3, "weight_decay": 0.01}, model.parameters())
"""

from __future__ import annotations

from shardwise.optim.adam import AdamNoBiasCorrection
from shardwise.optim.clipping import (
    clip_coefficient,
    clip_coefficient_tensor,
    global_norm,
    gradient_divisor,
    scale_,
    squared_norm,
)
from shardwise.optim.lamb import Lamb
from shardwise.optim.lion import Lion
from shardwise.optim.registry import (
    OPTIMIZERS,
    ZERO_SUPPORTED_OPTIMIZER_CLASSES,
    ZERO_SUPPORTED_OPTIMIZERS,
    build_optimizer,
    is_zero_supported,
    resolve_client_optimizer,
)

__all__ = [
    "OPTIMIZERS",
    "ZERO_SUPPORTED_OPTIMIZERS",
    "ZERO_SUPPORTED_OPTIMIZER_CLASSES",
    "AdamNoBiasCorrection",
    "Lamb",
    "Lion",
    "build_optimizer",
    "clip_coefficient",
    "clip_coefficient_tensor",
    "global_norm",
    "gradient_divisor",
    "is_zero_supported",
    "resolve_client_optimizer",
    "scale_",
    "squared_norm",
]
