"""The step's gradient divisor folded into torch's fused Adam/AdamW, bit for bit.

Every stage divides the reduced gradients by one number before the inner optimizer step
(:func:`shardwise.zero.step_math.plan_step`: average over ranks, unscale, clip). That division
is a pass over the gradients (read and write) before AdamW reads them again. torch's fused
Adam/AdamW kernels can take it themselves: with ``optimizer.grad_scale`` set (the attribute
``torch.amp.GradScaler`` uses) they compute ``grad / grad_scale`` in the same pass that updates
the parameters, and store that quotient back into the gradient.

The plan's divisor is an fp32 number, so the kernel's fp32 division and the separate
``torch._foreach_div_`` both round the same real quotient once, on every CPU kernel level
(``default``, AVX2, AVX-512; ``tests/unit/zero/test_grad_fold.py`` checks the two bitwise,
subnormal and huge gradients included). Gradients, masters, optimizer state and parameters
are then identical whichever path ran, on clipping steps as on the others.

Folding also needs the optimizer to read exactly the gradients the division would touch (all
fp32), to be a plain ``torch.optim.Adam``/``AdamW`` (or DeepSpeed's ``FusedAdam``/``DeepSpeedCPUAdam``,
which are torch's Adam under another name) with ``fused=True`` in every group, and no
``grad_scale``/``found_inf`` of someone else's set on it; otherwise nothing is folded.

Example:
    >>> foldable_divisor(4.0), foldable_divisor(1.0), foldable_divisor(0.1)
    (True, False, False)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch

from shardwise.optim.fused_adam import ADAM_CLASSES
from shardwise.zero.step_math import fp32

__all__ = ["divide_", "foldable_divisor", "folded_divisor", "scaled_step"]

_FUSED_TYPES = (torch.optim.Adam, torch.optim.AdamW, *ADAM_CLASSES)  # DeepSpeed's names, torch's update


def foldable_divisor(divisor: float) -> bool:
    """``divisor`` is a finite positive fp32 number other than 1 (1 needs no pass at all)."""
    return math.isfinite(divisor) and divisor > 0.0 and divisor != 1.0 and fp32(divisor) == divisor


def divide_(grads: Sequence[torch.Tensor], divisor: float) -> None:
    """The separate pass: ``grads /= divisor`` in place (nothing when ``divisor`` is 1)."""
    if divisor != 1.0 and grads:
        torch._foreach_div_(list(grads), divisor)


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
def folded_divisor(
    optimizer: torch.optim.Optimizer, grads: Sequence[torch.Tensor], divisor: float
) -> Iterator[bool]:
    """Around the inner optimizer's step: yields True when that step divides ``grads`` by
    ``divisor`` itself (bitwise as :func:`divide_`, see the module docstring), False when the
    caller must divide.

    Example:
        >>> # with folded_divisor(opt, grads, plan.divisor) as folded:
        >>> #     if not folded:
        >>> #         divide_(grads, plan.divisor)
        >>> #     opt.step()
    """
    foldable = foldable_divisor(divisor) and bool(grads) and _fused_optimizer(optimizer)
    if not foldable or not _reads_exactly(optimizer, grads):
        yield False
        return
    optimizer.grad_scale = torch.tensor(divisor, dtype=torch.float32, device=grads[0].device)  # type: ignore[attr-defined]
    try:
        yield True
    finally:
        del optimizer.grad_scale  # type: ignore[attr-defined]


def scaled_step(
    optimizer: torch.optim.Optimizer,
    grads: Sequence[torch.Tensor],
    divisor: float,
    scale: Callable[[], None],
    step: Callable[[], object] | None = None,
) -> bool:
    """The inner step on ``grads / divisor``: folded into the step where it can be, else
    ``scale()`` (the caller's division) first. ``step`` runs the step (default
    ``optimizer.step()``; stage 3 steps sub-groups, each call keeps the folded divisor).
    Returns whether it was folded."""
    with folded_divisor(optimizer, grads, divisor) as folded:
        if not folded:
            scale()
        if step is None:
            optimizer.step()
        else:
            step()
    return folded
