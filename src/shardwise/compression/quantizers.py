"""Fake quantization with straight-through gradients (DeepSpeed's quantizer formulas).

``quantize(x, bits, groups, symmetric, stochastic)`` rounds ``x`` onto at most ``2**bits``
levels per group (the flattened tensor split into ``groups`` equal rows), returns values in
``x``'s dtype, and passes gradients straight through. 1 bit is binary (sign times the mean
magnitude), 2 bits ternary (0.7 x mean magnitude threshold), as in DeepSpeed.
"""

from __future__ import annotations

import torch

__all__ = ["quantize", "quantize_values"]


def _round(x: torch.Tensor, stochastic: bool) -> torch.Tensor:
    if stochastic:
        return torch.floor(x + torch.rand_like(x))
    return torch.round(x)


def _symmetric(flat: torch.Tensor, bits: int, stochastic: bool) -> torch.Tensor:
    levels = 2**bits
    scale = 2 * flat.abs().amax(dim=1, keepdim=True) / levels
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return _round(flat / scale, stochastic).clamp(-levels // 2, levels // 2 - 1) * scale


def _asymmetric(flat: torch.Tensor, bits: int, stochastic: bool) -> torch.Tensor:
    levels = 2**bits
    low, high = flat.amin(dim=1, keepdim=True), flat.amax(dim=1, keepdim=True)
    scale = (high - low) / levels
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    zero = torch.round(low / scale) * scale
    return _round((flat - zero) / scale, stochastic).clamp(0, levels - 1) * scale + zero


def _ternary(flat: torch.Tensor) -> torch.Tensor:
    threshold = 0.7 * flat.abs().mean(dim=1, keepdim=True)
    keep = flat.abs() > threshold
    alpha = (flat.abs() * keep).sum(dim=1, keepdim=True) / keep.sum(dim=1, keepdim=True).clamp(min=1)
    return alpha * (flat > threshold) - alpha * (flat < -threshold)


def _binary(flat: torch.Tensor) -> torch.Tensor:
    return flat.sign() * flat.abs().mean(dim=1, keepdim=True)


def quantize_values(
    x: torch.Tensor, bits: int, groups: int, symmetric: bool, stochastic: bool
) -> torch.Tensor:
    """The quantized values of ``x`` (no autograd rule; see :func:`quantize`).

    Example:
        >>> q = quantize_values(torch.linspace(-1, 1, 64), bits=2, groups=1, symmetric=True, stochastic=False)
        >>> len(q.unique()) <= 4
        True
    """
    if bits >= 32:
        return x
    if x.numel() % groups:
        raise ValueError(
            f"cannot split {x.numel()} values into {groups} quantization groups (quantize_groups)"
        )
    flat = x.detach().float().reshape(groups, -1)
    if bits == 1:
        out = _binary(flat)
    elif bits == 2:
        out = _ternary(flat)
    elif symmetric:
        out = _symmetric(flat, bits, stochastic)
    else:
        out = _asymmetric(flat, bits, stochastic)
    return out.reshape(x.shape).to(x.dtype)


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        return q

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def quantize(
    x: torch.Tensor, bits: int, groups: int = 1, symmetric: bool = True, stochastic: bool = False
) -> torch.Tensor:
    """Fake-quantize ``x`` with a straight-through gradient (``d out / d x = 1``)."""
    q = quantize_values(x, bits, groups, symmetric, stochastic)
    return _StraightThrough.apply(x, q)


def quantize_in_range(
    x: torch.Tensor, bits: int, low: torch.Tensor, high: torch.Tensor, symmetric: bool
) -> torch.Tensor:
    """Fake-quantize ``x`` onto ``2**bits`` levels of a fixed range ``[low, high]`` (static
    activation calibration), straight-through gradient."""
    levels = 2**bits
    flat = x.detach().float()
    if symmetric:
        scale = 2 * torch.maximum(low.abs(), high.abs()).float() / levels
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        q = torch.round(flat / scale).clamp(-levels // 2, levels // 2 - 1) * scale
    else:
        scale = (high - low).float() / levels
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        zero = torch.round(low.float() / scale) * scale
        q = torch.round((flat - zero) / scale).clamp(0, levels - 1) * scale + zero
    return _StraightThrough.apply(x, q.to(x.dtype))
