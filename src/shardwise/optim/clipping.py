"""Global-norm gradient clipping maths (spec §7.3).

The clip is a global L2 norm over every gradient of the model, applied once per optimizer step.
With a loss scale (fp16) the norm is taken on the *scaled* gradients, and one combined scale
both unscales and clips:

    clip = ((scaled_norm / loss_scale) + 1e-6) / max_norm
    combined = loss_scale * max(1, clip)

With ``loss_scale=1`` the effect is the fp32 rule ``coef = min(1, max_norm / (norm + 1e-6))``.
``max_norm = 0`` disables clipping (the combined scale is then just ``loss_scale``).
The ZeRO stages divide the gradients by ``combined`` (:func:`gradient_divisor`): one correctly
rounded operation per element, which torch's fused Adam/AdamW can do inside its own pass
(:mod:`shardwise.zero.grad_fold`). :func:`clip_coefficient` is its reciprocal, for callers that
multiply.

Work is split so the sharded paths can share it: each rank computes the squared norm of the
gradients it holds (``squared_norm``), the squares are summed across ranks (``global_norm``),
and the scale is a pure function of the result (``gradient_divisor``, ``clip_coefficient``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from shardwise.comm.init import is_initialized

__all__ = [
    "CLIP_EPS",
    "clip_coefficient",
    "clip_coefficient_tensor",
    "global_norm",
    "gradient_divisor",
    "scale_",
    "squared_norm",
]

CLIP_EPS = 1e-6
"""Added to the norm before dividing by ``max_norm`` (DeepSpeed and torch both use 1e-6)."""


def squared_norm(tensors: Iterable[Tensor]) -> Tensor:
    """Sum of squares of all elements of ``tensors``, accumulated in fp32.

    Uses one ``torch._foreach_norm`` per device (fp32 accumulation even for bf16/fp16 inputs).
    Non-finite values propagate, so an overflow shows up as ``inf``/``nan``.

    Args:
        tensors: gradients (or any tensors); ``None`` entries are skipped.

    Returns:
        A 0-dim fp32 tensor on the first tensor's device (CPU when there are none).

    Example:
        >>> import torch
        >>> squared_norm([torch.tensor([3.0]), torch.tensor([4.0])])
        tensor(25.)
    """
    by_device: dict[torch.device, list[Tensor]] = {}
    for t in tensors:
        if t is None:
            continue
        by_device.setdefault(t.device, []).append(t)
    if not by_device:
        return torch.zeros((), dtype=torch.float32)
    out_device = next(iter(by_device))
    total = torch.zeros((), dtype=torch.float32, device=out_device)
    for group in by_device.values():
        norms = torch._foreach_norm(group, 2.0, dtype=torch.float32)
        total = total + torch.stack(norms).square().sum().to(out_device)
    return total


def global_norm(local_sq_sum: Tensor, group: object | Sequence[object] | None = None) -> Tensor:
    """The global L2 norm from this rank's squared partial norm.

    When torch.distributed is initialised, the squared sums are all-reduced with SUM over
    ``group`` (one process group, or a list of groups reduced in turn, e.g. the data-parallel
    group then the model-parallel group). With ``group=None`` the default (world) group is
    used. Without torch.distributed it is the local norm.

    Args:
        local_sq_sum: this rank's sum of squares (0-dim tensor, on the backend's device).
        group: a process group, a list of process groups, or None for the world.

    Returns:
        ``sqrt`` of the summed squares, as a new fp32 tensor (the input is not modified).

    Example:
        >>> import torch
        >>> global_norm(torch.tensor(25.0))  # single process
        tensor(5.)
    """
    total = local_sq_sum.detach().to(torch.float32).clone()
    if is_initialized():
        groups = list(group) if isinstance(group, (list, tuple)) else [group]
        from shardwise.comm import collectives  # the one door to torch.distributed (and its logger)

        for g in groups:
            collectives.all_reduce(total, op="sum", group=g)  # type: ignore[arg-type]
    return total.sqrt()


def gradient_divisor(total_norm: float | Tensor, max_norm: float, loss_scale: float = 1.0) -> float:
    """The number to divide the gradients by to unscale and clip them in one go (spec §7.3).

    Args:
        total_norm: global L2 norm of the (scaled) gradients.
        max_norm: ``gradient_clipping``; 0 (or less) disables clipping.
        loss_scale: current loss scale; 1.0 without fp16.

    Returns:
        ``loss_scale * max(1, clip)`` with ``clip = (total_norm / loss_scale + 1e-6) / max_norm``.
        A non-finite norm is an overflow the caller must handle (skip the step) before asking.

    Example:
        >>> round(gradient_divisor(10.0, 1.0), 6)  # norm 10 clipped to 1
        10.000001
        >>> gradient_divisor(0.5, 1.0)  # under the limit: unchanged
        1.0
        >>> gradient_divisor(20.0, 0.0, loss_scale=4.0)  # clipping off: unscale only
        4.0
    """
    if loss_scale <= 0.0:
        raise ValueError(f"gradient_divisor: loss_scale must be > 0, got {loss_scale}.")
    combined = float(loss_scale)
    if max_norm > 0.0:
        clip = (float(total_norm) / loss_scale + CLIP_EPS) / max_norm
        if clip > 1.0:
            combined = loss_scale * clip
    return combined


def clip_coefficient(total_norm: float | Tensor, max_norm: float, loss_scale: float = 1.0) -> float:
    """The gradient multiplier that unscales and clips in one go: ``1 / gradient_divisor(...)``.

    Example:
        >>> round(clip_coefficient(10.0, 1.0), 6)  # norm 10 clipped to 1
        0.1
        >>> clip_coefficient(0.5, 1.0)  # under the limit: unchanged
        1.0
        >>> clip_coefficient(20.0, 0.0, loss_scale=4.0)  # clipping off: unscale only
        0.25
    """
    return 1.0 / gradient_divisor(total_norm, max_norm, loss_scale)


def clip_coefficient_tensor(total_norm: Tensor, max_norm: float, loss_scale: float | Tensor = 1.0) -> Tensor:
    """Same as :func:`clip_coefficient`, but stays on the norm's device (no host sync).

    Useful on GPU, where reading the norm back to Python would stall the stream. ``loss_scale``
    may itself be a device tensor (a dynamic scaler's current scale).

    Args:
        total_norm: 0-dim tensor, global L2 norm of the (scaled) gradients.
        max_norm: ``gradient_clipping``; 0 disables clipping.
        loss_scale: current loss scale.

    Returns:
        A 0-dim fp32 tensor with the multiplier.
    """
    norm = total_norm.to(torch.float32)
    scale = torch.as_tensor(loss_scale, dtype=torch.float32, device=norm.device)
    if max_norm <= 0.0:
        return 1.0 / scale
    clip = (norm / scale + CLIP_EPS) / max_norm
    return 1.0 / (scale * torch.clamp(clip, min=1.0))


def scale_(tensors: Iterable[Tensor], multiplier: float | Tensor) -> None:
    """Multiply ``tensors`` in place by ``multiplier`` with one foreach call per device.

    Args:
        tensors: gradients to scale; ``None`` entries are skipped.
        multiplier: a Python float or a 0-dim tensor (e.g. from :func:`clip_coefficient_tensor`).
    """
    by_device: dict[torch.device, list[Tensor]] = {}
    for t in tensors:
        if t is not None:
            by_device.setdefault(t.device, []).append(t)
    for device, group in by_device.items():
        if isinstance(multiplier, Tensor):
            torch._foreach_mul_(group, multiplier.to(device=device))
        else:
            torch._foreach_mul_(group, multiplier)
