"""LAMB with DeepSpeed FusedLamb semantics, written with torch's multi-tensor (``_foreach``) ops.

The update for one parameter tensor ``w`` with gradient ``g`` at step ``t`` (spec §3.2.2 defaults):

    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    denom = sqrt(v) + eps                  (eps_inside_sqrt=False, the default)
          = sqrt(v + eps)                  (eps_inside_sqrt=True)
    u = m / denom + weight_decay * w
    ratio = clamp(||w|| / ||u||, min_coeff, max_coeff), or 1 when either norm is 0
    step_size = lr * sqrt(1 - beta2^t) / (1 - beta1^t)    (lr when bias_correction=False)
    w = w - step_size * ratio * u

Bias correction is folded into the step size rather than applied to ``m`` and ``v``, so ``eps``
acts on the uncorrected second moment; this is how FusedLamb behaves and why its numbers differ
slightly from a textbook LAMB. The trust ratio is per *tensor*: at ZeRO stage 0 the flat group
hands the optimizer one fp32 master per parameter (``zero.flat_group.FlatGroup``, unsharded), so it
is per parameter there as in FusedLamb; under stages 1-2 a flat shard is not a tensor, which is why
Lamb is not on the ZeRO-supported list (see ``registry``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from shardwise.optim.group_state import GroupTensors, collect_group, run_closure

__all__ = ["Lamb"]


class Lamb(torch.optim.Optimizer):
    """Layer-wise adaptive moments (LAMB) with FusedLamb's defaults and trust-ratio clamping.

    Args:
        params: parameters or parameter groups.
        lr: learning rate.
        bias_correction: fold Adam's bias corrections into the step size.
        betas: coefficients of the running averages of the gradient and its square.
        eps: added to the denominator for numerical stability.
        eps_inside_sqrt: use ``sqrt(v + eps)`` instead of ``sqrt(v) + eps``.
        weight_decay: decoupled weight decay, added to the update before the trust ratio.
        max_grad_norm: per-group gradient clipping applied before the moments; 0 disables it.
            (The engine's top-level ``gradient_clipping`` is the usual way to clip.)
        max_coeff: upper clamp of the trust ratio.
        min_coeff: lower clamp of the trust ratio.
        amsgrad: not supported; ``True`` raises ``ValueError`` (FusedLamb rejects it too).

    Example:
        >>> import torch
        >>> from shardwise.optim import Lamb
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = Lamb(model.parameters(), lr=1e-3, weight_decay=0.01)
        >>> model(torch.randn(3, 4)).sum().backward()
        >>> opt.step()
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        amsgrad: bool = False,
    ) -> None:
        if amsgrad:
            raise ValueError(
                "Lamb: amsgrad=True is not supported (FusedLamb has no AMSGrad variant); "
                "remove 'amsgrad' from optimizer.params or set it to false."
            )
        if lr < 0.0:
            raise ValueError(f"Lamb: lr must be >= 0, got {lr}.")
        if eps < 0.0:
            raise ValueError(f"Lamb: eps must be >= 0, got {eps}.")
        beta1, beta2 = betas
        if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
            raise ValueError(f"Lamb: betas must lie in [0, 1), got {tuple(betas)}.")
        if weight_decay < 0.0:
            raise ValueError(f"Lamb: weight_decay must be >= 0, got {weight_decay}.")
        if max_grad_norm < 0.0:
            raise ValueError(f"Lamb: max_grad_norm must be >= 0 (0 disables it), got {max_grad_norm}.")
        if not 0.0 <= min_coeff <= max_coeff:
            raise ValueError(
                f"Lamb: need 0 <= min_coeff <= max_coeff, got min_coeff={min_coeff}, max_coeff={max_coeff}."
            )
        defaults = {
            "lr": lr,
            "bias_correction": bias_correction,
            "betas": (float(beta1), float(beta2)),
            "eps": eps,
            "eps_inside_sqrt": eps_inside_sqrt,
            "weight_decay": weight_decay,
            "max_grad_norm": max_grad_norm,
            "max_coeff": max_coeff,
            "min_coeff": min_coeff,
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
            # parameters that missed an earlier step have their own count: own bias correction
            buckets = collect_group(self.state, group, ("exp_avg", "exp_avg_sq"), "Lamb")
            if not buckets:
                continue
            grad_factor = self._clip_factor(group, buckets)
            for step, t in buckets.items():
                exp_avgs, exp_avg_sqs = t.moments["exp_avg"], t.moments["exp_avg_sq"]
                self._update(group, step + 1, t.params, t.grads, exp_avgs, exp_avg_sqs, grad_factor)
                torch._foreach_add_(t.steps, 1.0)
        return loss

    @staticmethod
    def _clip_factor(group: dict[str, Any], buckets: dict[int, GroupTensors]) -> Tensor | None:
        """The gradient multiplier for ``max_grad_norm`` over the whole group, or None when off."""
        max_norm = group["max_grad_norm"]
        if max_norm <= 0.0:
            return None
        grads = [g for bucket in buckets.values() for g in bucket.grads]
        norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
        total = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]))
        clip = (total + 1e-6) / max_norm
        return 1.0 / torch.clamp(clip, min=1.0)

    @staticmethod
    def _update(
        group: dict[str, Any],
        step: int,
        params: list[Tensor],
        grads: list[Tensor],
        exp_avgs: list[Tensor],
        exp_avg_sqs: list[Tensor],
        grad_factor: Tensor | None,
    ) -> list[tuple[list[Tensor], Tensor]]:
        """Update ``params`` in place; returns ``(params, trust ratios)`` per device (one ratio each)."""
        beta1, beta2 = group["betas"]
        eps = group["eps"]
        weight_decay = group["weight_decay"]
        if grad_factor is not None:
            # Out of place: clipping inside the optimizer must not rewrite the user's .grad.
            grads = list(torch._foreach_mul(grads, grad_factor.to(grads[0].device)))

        torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)

        if group["eps_inside_sqrt"]:
            denom = torch._foreach_add(exp_avg_sqs, eps)
            torch._foreach_sqrt_(denom)
        else:
            denom = torch._foreach_sqrt(exp_avg_sqs)
            torch._foreach_add_(denom, eps)
        update = list(torch._foreach_div(exp_avgs, denom))
        del denom
        if weight_decay != 0.0:
            torch._foreach_add_(update, params, alpha=weight_decay)

        if group["bias_correction"]:
            step_size = group["lr"] * math.sqrt(1.0 - beta2**step) / (1.0 - beta1**step)
        else:
            step_size = group["lr"]

        # Trust ratios for all tensors at once: one stacked vector per device, no host sync.
        ratios = []
        for device_params, device_updates in _by_device(params, update):
            w_norm = torch.stack(torch._foreach_norm(device_params, 2.0, dtype=torch.float32))
            u_norm = torch.stack(torch._foreach_norm(device_updates, 2.0, dtype=torch.float32))
            ratio = torch.where(
                (w_norm > 0) & (u_norm > 0),
                (w_norm / u_norm).clamp(group["min_coeff"], group["max_coeff"]),
                torch.ones_like(w_norm),
            )
            scale = (ratio * -step_size).to(device_params[0].dtype)
            torch._foreach_mul_(device_updates, list(scale.unbind()))
            torch._foreach_add_(device_params, device_updates)
            ratios.append((device_params, ratio))
        return ratios


def _by_device(params: list[Tensor], updates: list[Tensor]) -> list[tuple[list[Tensor], list[Tensor]]]:
    """Split parallel lists by device so each stacked norm vector lives on one device."""
    if all(p.device == params[0].device for p in params):
        return [(params, updates)]
    grouped: dict[torch.device, tuple[list[Tensor], list[Tensor]]] = {}
    for p, u in zip(params, updates):
        entry = grouped.setdefault(p.device, ([], []))
        entry[0].append(p)
        entry[1].append(u)
    return list(grouped.values())
