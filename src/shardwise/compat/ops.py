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

from shardwise.optim.adam import AdamNoBiasCorrection
from shardwise.optim.lamb import Lamb
from shardwise.optim.lion import Lion
from shardwise.utils.logging import logger

__all__ = [
    "DeepSpeedCPUAdagrad",
    "DeepSpeedCPUAdam",
    "DeepSpeedCPULion",
    "FusedAdam",
    "FusedLamb",
    "FusedLion",
]


def _note_ignored(name: str, **settings: tuple[object, object]) -> None:
    """Warn for each DeepSpeed-only argument given a non-default value: ``arg=(value, default)``."""
    for arg, (value, default) in settings.items():
        if value != default:
            logger.warning(
                "%s(%s=%r) has no effect on shardwise: %s",
                name,
                arg,
                value,
                "optimizer states are always kept in fp32"
                if arg == "fp32_optimizer_states"
                else "DeepSpeed's Adagrad kernel has no AMSGrad either; torch's Adagrad runs",
            )


def _uncorrected_adam(
    params: Iterable[Any],
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    adam_w_mode: bool,
    amsgrad: bool,
    name: str,
) -> AdamNoBiasCorrection:
    """DeepSpeed's Adam kernels with ``bias_correction=False``: shardwise's uncorrected update."""
    if amsgrad:
        raise ValueError(
            f"{name}(bias_correction=False, amsgrad=True): DeepSpeed's kernels have no AMSGrad, and shardwise's "
            "uncorrected Adam neither; pass amsgrad=False"
        )
    return AdamNoBiasCorrection(
        params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adam_w_mode=adam_w_mode
    )


class FusedAdam(torch.optim.Adam):
    """DeepSpeed's ``FusedAdam``: Adam with decoupled weight decay when ``adam_w_mode`` (the default).

    With ``bias_correction=False`` (DeepSpeed's uncorrected update) the object built is a
    :class:`~shardwise.optim.adam.AdamNoBiasCorrection` with the same arguments, not a ``FusedAdam``.

    Example:
        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> type(FusedAdam([w], bias_correction=False)).__name__, type(FusedAdam([w])).__name__
        ('AdamNoBiasCorrection', 'FusedAdam')
    """

    def __new__(
        cls,
        params: Iterable[object],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
    ) -> Any:
        if not bias_correction:
            return _uncorrected_adam(params, lr, betas, eps, weight_decay, adam_w_mode, amsgrad, cls.__name__)
        return super().__new__(cls)

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
    ) -> None:
        super().__init__(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            decoupled_weight_decay=adam_w_mode,
        )


class DeepSpeedCPUAdam(FusedAdam):
    """DeepSpeed's ``DeepSpeedCPUAdam`` (``adamw_mode`` spelling); the update of :class:`FusedAdam`
    (``bias_correction=False`` builds an :class:`~shardwise.optim.adam.AdamNoBiasCorrection`)."""

    def __new__(
        cls,
        model_params: Iterable[object],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
        fp32_optimizer_states: bool = True,
    ) -> Any:
        _note_ignored(cls.__name__, fp32_optimizer_states=(fp32_optimizer_states, True))
        if not bias_correction:
            return _uncorrected_adam(
                model_params, lr, betas, eps, weight_decay, adamw_mode, amsgrad, cls.__name__
            )
        return torch.optim.Optimizer.__new__(cls)

    def __init__(
        self,
        model_params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
        fp32_optimizer_states: bool = True,
    ) -> None:
        super().__init__(
            model_params,
            lr=lr,
            betas=betas,
            eps=eps,
            adam_w_mode=adamw_mode,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
        )


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
        _note_ignored(
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


class DeepSpeedCPULion(Lion):
    """DeepSpeed's ``DeepSpeedCPULion`` on shardwise's Lion."""

    def __init__(
        self,
        model_params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        fp32_optimizer_states: bool = True,
    ) -> None:
        _note_ignored(type(self).__name__, fp32_optimizer_states=(fp32_optimizer_states, True))
        super().__init__(model_params, lr=lr, betas=betas, weight_decay=weight_decay)


FusedLamb = Lamb
"""DeepSpeed's ``FusedLamb``: shardwise's Lamb takes the same arguments."""
