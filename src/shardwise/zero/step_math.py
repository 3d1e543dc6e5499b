"""The step maths every ZeRO stage shares: norm, skip policy, and the one gradient divisor.

Each stage reduces its gradients differently, but all end with the global *squared* norm of
the reduced gradients, summed over ranks by one all-reduce (that reduction also detects
inf/NaN: no separate flag collective). Each stage states once its **mean divisor**: the
factor that turns its reduced gradients into the mean over ranks (stages 0-2: the post
divisor, since any pre-multiplier was applied before the collective; stage 3: the post
divisor over the pre-multiplier, because FSDP2's reduction is a plain sum).
:func:`plan_step` then decides, from those numbers alone:

- a non-finite norm skips the update, in every precision; it is an *overflow* (which the
  loss scaler answers) only where the precision checks for overflows (fp16, bf16 with
  ``check_grad_overflow``);
- otherwise the true norm is ``sqrt(squared_norm) / (mean_divisor * loss_scale)`` and one
  division averages, unscales and clips (:func:`shardwise.optim.clipping.gradient_divisor`,
  DeepSpeed's ``combined_scale``).

The divisor is rounded to fp32 once, here: torch's fused Adam/AdamW divides by an fp32
``grad_scale`` tensor and ``torch._foreach_div_`` by the scalar cast to fp32, so with the
rounded number both produce the same correctly rounded quotient ``fl(g / divisor)`` and
folding the division into the optimizer (:mod:`shardwise.zero.grad_fold`) changes no bit.

Example:
    >>> plan = plan_step(400.0, mean_divisor=2.0, loss_scale=1.0, max_norm=1.0, check_overflow=False)
    >>> plan.apply, plan.grad_norm, round(plan.divisor, 4)  # norm 20 / 2 = 10, clipped to 1
    (True, 10.0, 20.0)
    >>> plan_step(float("nan"), mean_divisor=2.0, loss_scale=1.0, max_norm=1.0, check_overflow=False).apply
    False
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

from shardwise.optim.clipping import gradient_divisor
from shardwise.zero.strategy import StepResult

__all__ = ["StepPlan", "fp32", "plan_step"]


def fp32(value: float) -> float:
    """``value`` rounded to the nearest fp32 number (``inf`` beyond fp32's range).

    Example:
        >>> fp32(0.1) == 0.1, fp32(0.5) == 0.5, fp32(1e39)
        (False, True, inf)
    """
    try:
        return float(struct.unpack("f", struct.pack("f", value))[0])
    except OverflowError:
        return math.copysign(math.inf, value)


@dataclass(frozen=True)
class StepPlan:
    """What one optimizer step does.

    Attributes:
        apply: update the parameters (False: skip, the gradients are non-finite).
        grad_norm: the true global norm (mean over ranks, unscaled, before clipping); ``inf``
            when skipped.
        divisor: divide the reduced gradients by this before (or within) the inner step
            (averages, unscales and clips in one pass); an fp32 number; ``inf`` when skipped.
        overflow: the skip is one the loss scaler must answer (see :class:`StepResult`).
    """

    apply: bool
    grad_norm: float
    divisor: float
    overflow: bool

    def result(self) -> StepResult:
        """The :class:`~shardwise.zero.strategy.StepResult` the strategy reports."""
        return StepResult(applied=self.apply, grad_norm=self.grad_norm, overflow=self.overflow)


def plan_step(
    squared_norm: float,
    *,
    mean_divisor: float,
    loss_scale: float,
    max_norm: float,
    check_overflow: bool,
) -> StepPlan:
    """Decide one step from the reduced squared gradient norm.

    Args:
        squared_norm: global sum of squares of the reduced (still scaled) gradients.
        mean_divisor: what turns the stage's reduced gradients into the mean over ranks.
        loss_scale: the current loss scale (1.0 without fp16).
        max_norm: ``gradient_clipping``; 0 disables clipping.
        check_overflow: the precision treats non-finite gradients as overflows for the loss scaler.

    Returns:
        The :class:`StepPlan`: skip (non-finite norm) or apply with one divisor.
    """
    divisor = mean_divisor * loss_scale
    scaled_norm = math.sqrt(squared_norm)
    norm = scaled_norm / divisor
    if not math.isfinite(norm):
        return StepPlan(apply=False, grad_norm=math.inf, divisor=math.inf, overflow=check_overflow)
    combined = fp32(gradient_divisor(scaled_norm, max_norm, loss_scale=divisor))
    return StepPlan(apply=True, grad_norm=norm, divisor=combined, overflow=False)
