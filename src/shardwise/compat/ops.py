"""``deepspeed.ops`` optimizer classes, as shardwise's optimizers with DeepSpeed's constructor arguments.

DeepSpeed's CPU and fused kernels are C++/CUDA extensions; the update rules are Adam/AdamW,
Adagrad, Lion and Lamb, which shardwise runs with torch's kernels (:mod:`shardwise.optim`).
Each class takes the DeepSpeed class's arguments, so ``DeepSpeedCPUAdam(model.parameters(),
lr=...)`` in a script or a client (accelerate builds it for optimizer offload) builds the same update.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from shardwise.optim.fused_adam import DeepSpeedCPUAdam, FusedAdam, note_ignored
from shardwise.optim.lamb import Lamb
from shardwise.optim.lion import DeepSpeedCPULion, Lion

__all__ = [
    "DeepSpeedCPUAdagrad",
    "DeepSpeedCPUAdam",
    "DeepSpeedCPULion",
    "FusedAdam",
    "FusedLamb",
    "FusedLion",
]


class DeepSpeedCPUAdagrad(torch.optim.Adagrad):
    """DeepSpeed's ``DeepSpeedCPUAdagrad`` on torch's Adagrad."""

    def __init__(
        self,
        model_params: Iterable[Any],
        lr: float = 1e-2,
        eps: float = 1e-10,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        fp32_optimizer_states: bool = True,
    ) -> None:
        note_ignored(
            type(self).__name__, amsgrad=(amsgrad, False), fp32_optimizer_states=(fp32_optimizer_states, True)
        )
        super().__init__(model_params, lr=lr, eps=eps, weight_decay=weight_decay)


class FusedLion(Lion):
    """DeepSpeed's ``FusedLion`` on shardwise's Lion."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        set_grad_none: bool = True,
    ) -> None:
        super().__init__(params, lr=lr, betas=betas, weight_decay=weight_decay)


FusedLamb = Lamb
"""DeepSpeed's ``FusedLamb``: shardwise's Lamb takes the same arguments."""
