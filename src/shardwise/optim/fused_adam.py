"""DeepSpeed's ``FusedAdam`` and ``DeepSpeedCPUAdam``: torch's Adam/AdamW under DeepSpeed's names.

DeepSpeed builds these for ``"optimizer": {"type": "Adam"}`` or ``"AdamW"`` (``DeepSpeedCPUAdam``
with ZeRO's optimizer offload), so code written for DeepSpeed asks
``isinstance(optimizer, FusedAdam)``. shardwise builds them for the same configs
(:mod:`shardwise.optim.registry`); the update is torch's Adam with ``decoupled_weight_decay`` for
AdamW mode, the same code path as ``torch.optim.AdamW`` (which is that subclass of Adam), with
torch's fused kernel where it exists. ``bias_correction=False`` builds
:class:`~shardwise.optim.adam.AdamNoBiasCorrection` instead. ``deepspeed.ops.adam`` re-exports them.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch

from shardwise.optim.adam import AdamNoBiasCorrection
from shardwise.optim.fp32_adam_states import fp32_state_adam_step, is_low_precision, restore_fp32_states
from shardwise.utils.logging import logger

__all__ = ["ADAM_CLASSES", "DeepSpeedCPUAdam", "FusedAdam", "note_ignored"]


def note_ignored(name: str, **settings: tuple[object, object]) -> None:
    """Warn for each DeepSpeed-only argument given a non-default value: ``arg=(value, default)``."""
    for arg, (value, default) in settings.items():
        if value != default:
            logger.warning(
                "%s(%s=%r) has no effect on shardwise: %s",
                name,
                arg,
                value,
                "optimizer states take the parameters' dtype (fp32 masters inside the engine)"
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

    The keyword-only ``fused``/``foreach``/``maximize`` are torch's (shardwise picks the kernel).

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
        *,
        fused: bool | None = None,
        foreach: bool | None = None,
        maximize: bool = False,
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
        *,
        fused: bool | None = None,
        foreach: bool | None = None,
        maximize: bool = False,
    ) -> None:
        super().__init__(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            decoupled_weight_decay=adam_w_mode,
            fused=fused,
            foreach=foreach,
            maximize=maximize,
        )


def _unhooked_step(cls: type[torch.optim.Optimizer]) -> Callable[..., Any]:
    """``cls.step`` without torch's step-hook wrapper: a subclass's own ``step`` is wrapped already,
    so calling the parent's wrapped one would run the step pre/post hooks twice."""
    return inspect.unwrap(cls.step, stop=lambda f: not getattr(f, "hooked", False))


class DeepSpeedCPUAdam(FusedAdam):
    """DeepSpeed's ``DeepSpeedCPUAdam`` (``adamw_mode`` spelling); the update of :class:`FusedAdam`
    (``bias_correction=False`` builds an :class:`~shardwise.optim.adam.AdamNoBiasCorrection`).

    ``fp32_optimizer_states=True`` (DeepSpeed's default) keeps fp32 moments for 16-bit parameters and
    computes their update in fp32 (:mod:`shardwise.optim.fp32_adam_states`); ``False`` keeps the moments
    in the parameter's dtype. fp32 parameters (the engine's masters) step as :class:`FusedAdam` either way.
    """

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
        *,
        fused: bool | None = None,
        foreach: bool | None = None,
        maximize: bool = False,
    ) -> Any:
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
        *,
        fused: bool | None = None,
        foreach: bool | None = None,
        maximize: bool = False,
    ) -> None:
        super().__init__(
            model_params,
            lr=lr,
            betas=betas,
            eps=eps,
            adam_w_mode=adamw_mode,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            fused=fused,
            foreach=foreach,
            maximize=maximize,
        )
        self.fp32_optimizer_states = fp32_optimizer_states

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One Adam step; 16-bit parameters with fp32 moments when ``fp32_optimizer_states``."""
        adam_step = _unhooked_step(FusedAdam)
        if not self.fp32_optimizer_states:
            return adam_step(self, closure)
        low = [[p for p in group["params"] if p.grad is not None and is_low_precision(p)] for group in self.param_groups]
        if not any(low):
            return adam_step(self, closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        held = [(p, p.grad) for params in low for p in params]
        for param, _ in held:
            param.grad = None  # torch's step skips them; they step below with fp32 moments
        try:
            adam_step(self)
        finally:
            for param, grad in held:
                param.grad = grad
        for group, params in zip(self.param_groups, low, strict=True):
            fp32_state_adam_step(self, group, params)
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load, which casts every state to its parameter's dtype; 16-bit parameters then get
        their fp32 moments back when ``fp32_optimizer_states``."""
        super().load_state_dict(state_dict)
        if self.fp32_optimizer_states:
            restore_fp32_states(self, state_dict)


ADAM_CLASSES: tuple[type[torch.optim.Optimizer], ...] = (FusedAdam, DeepSpeedCPUAdam)
"""DeepSpeed's Adam classes: torch's Adam update exactly, so element-wise and foldable like it."""
