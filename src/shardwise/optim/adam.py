"""Adam/AdamW *without* bias correction, for configs that say ``"bias_correction": false``.

torch's Adam and AdamW always bias-correct and have no switch, yet DeepSpeed configs in the wild
ask for the uncorrected update (BERT pre-training recipes, every 1-bit Adam / 0/1 Adam example).
The difference is large early on (at step 1 with ``beta2=0.999`` the uncorrected step is about
3x the corrected one), so quietly using torch's kernels would change training. This class is the
uncorrected FusedAdam update, written with ``_foreach`` ops; with ``bias_correction`` left on, the
registry uses torch's own fused kernels instead.

    g = g + weight_decay * w                 (adam_w_mode=False: L2 penalty in the gradient)
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    w = w * (1 - lr * weight_decay)          (adam_w_mode=True: decoupled decay)
    w = w - lr * m / (sqrt(v) + eps)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from shardwise.optim.group_state import collect_group, run_closure

__all__ = ["AdamNoBiasCorrection"]


class AdamNoBiasCorrection(torch.optim.Optimizer):
    """Adam (or AdamW) with FusedAdam's ``bias_correction=False`` update.

    Args:
        params: parameters or parameter groups.
        lr: learning rate.
        betas: coefficients of the running averages of the gradient and its square.
        eps: added to ``sqrt(v)``.
        weight_decay: decay coefficient; decoupled when ``adam_w_mode``, else an L2 gradient term.
        adam_w_mode: decoupled (AdamW) weight decay.

    Example:
        >>> import torch
        >>> from shardwise.optim import AdamNoBiasCorrection
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = AdamNoBiasCorrection(model.parameters(), lr=1e-3, weight_decay=0.01)
        >>> model(torch.randn(3, 4)).sum().backward()
        >>> opt.step()
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        adam_w_mode: bool = True,
    ) -> None:
        if lr < 0.0:
            raise ValueError(f"Adam: lr must be >= 0, got {lr}.")
        if eps < 0.0:
            raise ValueError(f"Adam: eps must be >= 0, got {eps}.")
        beta1, beta2 = betas
        if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
            raise ValueError(f"Adam: betas must lie in [0, 1), got {tuple(betas)}.")
        if weight_decay < 0.0:
            raise ValueError(f"Adam: weight_decay must be >= 0, got {weight_decay}.")
        defaults = {
            "lr": lr,
            "betas": (float(beta1), float(beta2)),
            "eps": eps,
            "weight_decay": weight_decay,
            "adam_w_mode": adam_w_mode,
        }
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
            for tensors in collect_group(self.state, group, ("exp_avg", "exp_avg_sq"), "Adam").values():
                params, grads, steps = tensors.params, tensors.grads, tensors.steps
                exp_avgs, exp_avg_sqs = tensors.moments["exp_avg"], tensors.moments["exp_avg_sq"]
                if weight_decay != 0.0 and not group["adam_w_mode"]:
                    grads = list(torch._foreach_add(grads, params, alpha=weight_decay))
                torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
                torch._foreach_mul_(exp_avg_sqs, beta2)
                torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)
                denom = torch._foreach_sqrt(exp_avg_sqs)
                torch._foreach_add_(denom, group["eps"])
                if weight_decay != 0.0 and group["adam_w_mode"]:
                    torch._foreach_mul_(params, 1.0 - lr * weight_decay)
                torch._foreach_addcdiv_(params, exp_avgs, denom, value=-lr)
                torch._foreach_add_(steps, 1.0)
        return loss
