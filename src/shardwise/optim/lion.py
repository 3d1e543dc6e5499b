"""Lion (EvoLved Sign Momentum) with DeepSpeed FusedLion's defaults, using torch's ``_foreach`` ops.

The update for one tensor ``w`` with gradient ``g``:

    w = w * (1 - lr * weight_decay)                  (decoupled weight decay)
    w = w - lr * sign(beta1 * m + (1 - beta1) * g)
    m = beta2 * m + (1 - beta2) * g

DeepSpeed's defaults are ``lr=1e-3, betas=(0.9, 0.999), weight_decay=0`` (spec §3.2.3); the paper
suggests a 3-10x smaller lr than AdamW, but we keep DeepSpeed's numbers so configs mean the same.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from shardwise.optim.fused_adam import note_ignored
from shardwise.optim.group_state import collect_group, run_closure

__all__ = ["DeepSpeedCPULion", "Lion"]


class Lion(torch.optim.Optimizer):
    """Sign-momentum optimizer with decoupled weight decay (FusedLion semantics).

    Args:
        params: parameters or parameter groups.
        lr: learning rate.
        betas: ``beta1`` interpolates the update direction, ``beta2`` the stored momentum.
        weight_decay: decoupled weight decay coefficient.

    Example:
        >>> import torch
        >>> from shardwise.optim import Lion
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = Lion(model.parameters(), lr=1e-4, weight_decay=0.1)
        >>> model(torch.randn(3, 4)).sum().backward()
        >>> opt.step()
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
    ) -> None:
        if lr < 0.0:
            raise ValueError(f"Lion: lr must be >= 0, got {lr}.")
        beta1, beta2 = betas
        if not (0.0 <= beta1 <= 1.0 and 0.0 <= beta2 <= 1.0):
            raise ValueError(f"Lion: betas must lie in [0, 1], got {tuple(betas)}.")
        if weight_decay < 0.0:
            raise ValueError(f"Lion: weight_decay must be >= 0, got {weight_decay}.")
        defaults = {"lr": lr, "betas": (float(beta1), float(beta2)), "weight_decay": weight_decay}
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Perform one optimisation step.

        Args:
            closure: re-evaluates the model and returns the loss.

        Returns:
            The closure's loss, or None.
        """
        loss = run_closure(closure)
        for group in self.param_groups:
            lr = group["lr"]
            beta1, beta2 = group["betas"]
            weight_decay = group["weight_decay"]
            # (Lion has no bias correction: the step count is bookkeeping only)
            for tensors in collect_group(self.state, group, ("exp_avg",), "Lion").values():
                params, grads, exp_avgs = tensors.params, tensors.grads, tensors.moments["exp_avg"]
                direction = torch._foreach_lerp(exp_avgs, grads, 1.0 - beta1)
                torch._foreach_sign_(direction)
                if weight_decay != 0.0:
                    torch._foreach_mul_(params, 1.0 - lr * weight_decay)
                torch._foreach_add_(params, direction, alpha=-lr)
                del direction
                torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta2)
                torch._foreach_add_(tensors.steps, 1.0)
        return loss


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
        note_ignored(type(self).__name__, fp32_optimizer_states=(fp32_optimizer_states, True))
        super().__init__(model_params, lr=lr, betas=betas, weight_decay=weight_decay)
