"""Pruning masks: top-k selection with a straight-through gradient, and block patterns.

:func:`topk_mask` keeps the ``ceil(dense_ratio * n)`` highest scores (DeepSpeed's
``TopKBinarizer``): the mask is 0/1 in the forward and passes the gradient unchanged to the
scores, so learnable scores (method ``topk``) train.
"""

from __future__ import annotations

import math

import torch

__all__ = ["block_mask", "kept_count", "parse_block_pattern", "topk_mask", "topk_values"]


def kept_count(n: int, dense_ratio: float) -> int:
    """How many of ``n`` entries a ``dense_ratio`` keeps (``ceil``, at least one)."""
    return max(1, min(n, math.ceil(dense_ratio * n - 1e-9)))


def topk_values(scores: torch.Tensor, dense_ratio: float) -> torch.Tensor:
    """A 0/1 tensor shaped like ``scores`` that keeps the highest ``dense_ratio`` of them.

    Example:
        >>> topk_values(torch.tensor([3.0, 1.0, 2.0, 0.0]), 0.5).tolist()
        [1.0, 0.0, 1.0, 0.0]
    """
    flat = scores.detach().flatten()
    keep = kept_count(flat.numel(), dense_ratio)
    mask = torch.zeros_like(flat)
    mask[flat.topk(keep, sorted=False).indices] = 1.0
    return mask.view_as(scores)


class _TopK(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, scores: torch.Tensor, dense_ratio: float) -> torch.Tensor:
        return topk_values(scores, dense_ratio)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def topk_mask(scores: torch.Tensor, dense_ratio: float) -> torch.Tensor:
    """:func:`topk_values` with a straight-through gradient to ``scores``."""
    return _TopK.apply(scores, dense_ratio)


def parse_block_pattern(pattern: str) -> tuple[str, int, int]:
    """``"4x1"`` -> ``("block", 4, 1)`` (4 rows x 1 column blocks); ``"2:4"`` -> ``("nm", 2, 4)``."""
    for sep, kind in (("x", "block"), (":", "nm")):
        if sep in pattern:
            left, right = pattern.split(sep, 1)
            if left.isdigit() and right.isdigit() and int(left) > 0 and int(right) > 0:
                if kind == "nm" and int(left) > int(right):
                    break
                return kind, int(left), int(right)
    raise ValueError(f"block_pattern {pattern!r} is neither NxM (e.g. '4x1') nor N:M (e.g. '2:4', N <= M)")


def block_mask(scores: torch.Tensor, pattern: str, dense_ratio: float) -> torch.Tensor:
    """A 0/1 mask over a 2-D ``scores`` matrix that prunes whole blocks.

    ``NxM``: scores are summed over N-row x M-column blocks, the highest ``dense_ratio`` of the
    blocks are kept. ``N:M``: in each run of M consecutive entries of a row the N highest are
    kept (``dense_ratio`` is then N/M). A shape the block does not divide raises ValueError.
    """
    kind, n, m = parse_block_pattern(pattern)
    rows, cols = scores.shape
    if kind == "nm":
        if cols % m:
            raise ValueError(f"block_pattern {pattern!r}: {cols} columns are not a multiple of {m}")
        runs = scores.detach().reshape(rows, cols // m, m)
        mask = torch.zeros_like(runs)
        mask.scatter_(2, runs.topk(n, dim=2).indices, 1.0)
        return mask.reshape(rows, cols)
    if rows % n or cols % m:
        raise ValueError(f"block_pattern {pattern!r} does not divide a {rows}x{cols} weight")
    blocks = scores.detach().reshape(rows // n, n, cols // m, m).sum(dim=(1, 3))
    kept = topk_values(blocks, dense_ratio)
    return kept.repeat_interleave(n, 0).repeat_interleave(m, 1)
