"""Unstructured and semi-structured sparse pruning of single weights.

``l1``: the smallest-magnitude weights are masked when the technique switches on;
``topk``: one learnable score per weight, the highest ``dense_ratio`` kept every forward;
``snip_momentum``: a SNIP saliency ``|w * dL/dw|`` averaged with momentum 0.9 over the backward
passes (and across data-parallel ranks), re-pruned every ``schedule_offset_stride`` steps from
``schedule_offset`` to ``schedule_offset_end`` in ``block_pattern`` blocks (``NxM`` blocks, or
``N:M``: N kept of every M), the kept fraction falling on a cubic schedule from 1 to
``dense_ratio``; the mask is frozen after ``schedule_offset_end``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from shardwise.compression.masks import block_mask, parse_block_pattern
from shardwise.compression.structured import StructuredPruning
from shardwise.config.errors import ConfigError

__all__ = ["SNIP_MOMENTUM", "SparsePruning", "snip_density"]

SNIP_MOMENTUM = 0.9


def snip_density(step: int, start: int, end: int, dense_ratio: float) -> float:
    """The kept fraction at ``step`` (cubic from 1 at ``start`` to ``dense_ratio`` at ``end``).

    Example:
        >>> [round(snip_density(s, 10, 20, 0.4), 3) for s in (10, 15, 20, 30)]
        [1.0, 0.475, 0.4, 0.4]
    """
    if end <= start or step >= end:
        return dense_ratio
    progress = max(0.0, (step - start) / (end - start))
    return dense_ratio + (1.0 - dense_ratio) * (1.0 - progress) ** 3


class SparsePruning(StructuredPruning):
    """Sparse pruning on one ``Linear`` or ``Conv2d`` (see the module docstring)."""

    name = "sparse_pruning"

    def __init__(
        self, shared: Mapping[str, Any], params: Mapping[str, Any], key: str, module: nn.Module
    ) -> None:
        super().__init__(shared, params, key, module)
        self.end = shared.get("schedule_offset_end")
        self.stride = int(shared.get("schedule_offset_stride") or 1)
        self.pattern = str(shared.get("block_pattern") or "4x1")
        if self.method == "snip_momentum":
            weight: torch.Tensor = module.weight  # type: ignore[assignment]
            try:
                parse_block_pattern(self.pattern)
                block_mask(torch.ones(weight.shape[0], weight[0].numel()), self.pattern, self.dense_ratio)
            except ValueError as err:
                raise ConfigError(
                    f"{key.split('.different_groups')[0]}.shared_parameters.block_pattern",
                    f"{err} (module {type(module).__name__} {tuple(weight.shape)})",
                    "pick a pattern that divides every matched weight, or exclude the module",
                    self.pattern,
                ) from None
            if not hasattr(module, "snip_score"):
                module.register_buffer("snip_score", torch.zeros_like(weight, dtype=torch.float32))

    def collecting(self, step: int) -> bool:
        """snip_momentum gathers saliency for the pruning at ``step`` (within the window)."""
        return self.method == "snip_momentum" and self.end is not None and step <= int(self.end)

    def update(self, module: nn.Module, step: int) -> None:
        if self.method != "snip_momentum":
            super().update(module, step)
            return
        self.active = step >= self.schedule_offset
        end = int(self.end or 0)
        if self.active and step <= end and (step - self.schedule_offset) % self.stride == 0:
            from shardwise.comm import collectives
            from shardwise.comm.init import get_world_size, is_initialized

            score: torch.Tensor = module.snip_score  # type: ignore[assignment]
            if is_initialized() and get_world_size() > 1:
                collectives.all_reduce(score, op="avg")
            density = snip_density(step, self.schedule_offset, end, self.dense_ratio)
            flat = score.reshape(score.shape[0], -1)
            if not bool(flat.any()):  # no backward seen yet: fall back on the weights' magnitude
                weight: torch.Tensor = module.weight  # type: ignore[assignment]
                flat = weight.detach().abs().reshape(flat.shape).float()
            with torch.no_grad():
                getattr(module, self.mask_name).copy_(block_mask(flat, self.pattern, density).view_as(score))
        self._step = step

    def transform(
        self, module: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        out, bias = super().transform(module, weight, bias)
        if (
            self.method == "snip_momentum"
            and module.training
            and out.requires_grad
            and self.collecting(getattr(self, "_step", 0))
        ):
            score: torch.Tensor = module.snip_score  # type: ignore[assignment]
            values = out.detach()

            def accumulate(grad: torch.Tensor) -> None:
                with torch.no_grad():
                    score.mul_(SNIP_MOMENTUM).add_((values * grad).abs().float())

            out.register_hook(accumulate)
        return out, bias
