"""The step's gradient multiplier folded into torch's fused Adam/AdamW, where that is exact.

Every stage multiplies the reduced gradients by one number before the inner optimizer step
(:func:`shardwise.zero.step_math.plan_step`: average over ranks, unscale, clip). That multiply is
a pass over the gradients (read and write) before AdamW reads them again. torch's fused
Adam/AdamW kernels can take the scaling themselves: with ``optimizer.grad_scale`` set (the
attribute ``torch.amp.GradScaler`` uses) they compute ``grad / grad_scale`` in the same pass
that updates the parameters, and store that quotient back into the gradient.

``g / (1/m)`` equals ``g * m`` bit for bit when ``m`` is a power of two: ``1/m`` is then
exact, and both IEEE operations round the same real number ``g * m`` (subnormal results
included). So the multiplier is folded only when it is a power of two, which is the case on
every step that does not clip (``1 / (ranks x loss scale)`` with power-of-two world sizes and
loss scales); a clipping step keeps the separate multiply. Gradients, masters, optimizer
state and parameters are then identical to the separate multiply's, not merely close.

Folding also needs the optimizer to read exactly the gradients the multiply would touch (all
fp32), to be a plain ``torch.optim.Adam``/``AdamW`` with ``fused=True`` in every group, and no
``grad_scale``/``found_inf`` of someone else's set on it; otherwise nothing is folded.

Example:
    >>> power_of_two_reciprocal(0.25), power_of_two_reciprocal(0.3), power_of_two_reciprocal(1.0)
    (4.0, None, None)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch

__all__ = ["folded_multiplier", "power_of_two_reciprocal", "scaled_step"]

_FUSED_TYPES = (torch.optim.Adam, torch.optim.AdamW)
_FP32_MIN_EXPONENT = -125  # 2**-126 (frexp exponent -125) is the smallest normal fp32 power of two
_FP32_MAX_EXPONENT = 128  # 2**127 (frexp exponent 128) is the largest


def power_of_two_reciprocal(multiplier: float) -> float | None:
    """``1 / multiplier`` when ``multiplier`` is a power of two other than 1 whose reciprocal is a
    normal fp32 number (so dividing by it equals multiplying by ``multiplier`` exactly), else None."""
    if not (math.isfinite(multiplier) and multiplier > 0.0) or multiplier == 1.0:
        return None
    mantissa, exponent = math.frexp(multiplier)
    if mantissa != 0.5 or not (_FP32_MIN_EXPONENT <= 2 - exponent <= _FP32_MAX_EXPONENT):
        return None
    return 1.0 / multiplier


def _fused_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    """A plain torch Adam/AdamW whose every group runs the fused kernel, with no AMP scaling of its own."""
    if type(optimizer) not in _FUSED_TYPES or not getattr(optimizer, "_step_supports_amp_scaling", False):
        return False
    if any(getattr(optimizer, name, None) is not None for name in ("grad_scale", "found_inf")):
        return False
    return all(
        group.get("fused") and not group.get("capturable") and not group.get("differentiable")
        for group in optimizer.param_groups
    )


def _reads_exactly(optimizer: torch.optim.Optimizer, grads: Sequence[torch.Tensor]) -> bool:
    """The optimizer's parameters' gradients are exactly ``grads`` (the same tensors), all fp32."""
    read = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if len(read) != len(grads) or {id(g) for g in read} != {id(g) for g in grads}:
        return False
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    return all(t.dtype == torch.float32 for t in [*read, *params])


@contextmanager
def folded_multiplier(
    optimizer: torch.optim.Optimizer, grads: Sequence[torch.Tensor], multiplier: float
) -> Iterator[bool]:
    """Around the inner optimizer's step: yields True when that step applies ``multiplier`` to
    ``grads`` itself (exactly, see the module docstring), False when the caller must multiply.

    Example:
        >>> # with folded_multiplier(opt, grads, plan.multiplier) as folded:
        >>> #     if not folded:
        >>> #         torch._foreach_mul_(grads, plan.multiplier)
        >>> #     opt.step()
    """
    reciprocal = power_of_two_reciprocal(multiplier)
    foldable = reciprocal is not None and bool(grads) and _fused_optimizer(optimizer)
    if reciprocal is None or not foldable or not _reads_exactly(optimizer, grads):
        yield False
        return
    optimizer.grad_scale = torch.tensor(reciprocal, dtype=torch.float32, device=grads[0].device)  # type: ignore[attr-defined]
    try:
        yield True
    finally:
        del optimizer.grad_scale  # type: ignore[attr-defined]


def scaled_step(
    optimizer: torch.optim.Optimizer,
    grads: Sequence[torch.Tensor],
    multiplier: float,
    scale: Callable[[], None],
) -> bool:
    """The inner step on ``grads`` times ``multiplier``: folded into the step where exact, else
    ``scale()`` (the caller's multiply) first. Returns whether it was folded."""
    with folded_multiplier(optimizer, grads, multiplier) as folded:
        if not folded:
            scale()
        optimizer.step()
    return folded
