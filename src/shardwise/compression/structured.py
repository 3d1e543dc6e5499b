"""The common part of the pruning techniques: a 0/1 mask over units scored by the weights.

A unit is one weight (sparse pruning), an output row (row pruning), an output channel (channel
pruning) or an attention head's input columns (head pruning). Method ``l1`` scores the units by
their weights' magnitude when the technique switches on (step ``schedule_offset``) and freezes
that mask; method ``topk`` learns one score per unit (a parameter, initialised from the same
magnitudes) and keeps the ``dense_ratio`` highest in every forward, gradients reaching the scores
straight through. The mask is the module's buffer ``<technique>_mask`` and the scores its
parameter ``<technique>_scores``, so both are saved with the model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from shardwise.compression.layers import ModuleTechnique
from shardwise.compression.masks import topk_mask, topk_values

__all__ = ["StructuredPruning"]


class StructuredPruning(ModuleTechnique):
    """A pruning technique over the units :meth:`unit_scores` defines (see the module docstring)."""

    prunes_bias = False

    def __init__(
        self, shared: Mapping[str, Any], params: Mapping[str, Any], key: str, module: nn.Module
    ) -> None:
        super().__init__(int(shared["schedule_offset"]))
        self.key = key
        self.method = str(shared.get("method", "topk"))
        self.dense_ratio = float(params.get("dense_ratio") or shared.get("dense_ratio") or 1.0)
        self.frozen = False  # the l1 mask was computed
        self.check_module(module)
        weight: torch.Tensor = module.weight  # type: ignore[assignment]
        scores = self.unit_scores(weight.detach())
        if not hasattr(module, self.mask_name):
            module.register_buffer(self.mask_name, torch.ones_like(scores, dtype=torch.float32))
        if self.method == "topk" and not hasattr(module, self.scores_name):
            module.register_parameter(self.scores_name, nn.Parameter(scores.float().clone()))

    @property
    def mask_name(self) -> str:
        """The module buffer that holds the 0/1 mask."""
        return f"{self.name}_mask"

    @property
    def scores_name(self) -> str:
        """The module parameter that holds the learnable scores (method ``topk``)."""
        return f"{self.name}_scores"

    def check_module(self, module: nn.Module) -> None:
        """Raise ConfigError when the technique cannot act on ``module``."""

    def unit_scores(self, weight: torch.Tensor) -> torch.Tensor:
        """One magnitude per unit (overridden: the weights' absolute values by default)."""
        return weight.abs()

    def expand(self, mask: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The unit mask broadcast over the weight (identity for per-weight masks)."""
        return mask

    def update(self, module: nn.Module, step: int) -> None:
        super().update(module, step)
        if self.active and self.method == "l1" and not self.frozen:
            weight: torch.Tensor = module.weight  # type: ignore[assignment]
            with torch.no_grad():
                getattr(module, self.mask_name).copy_(
                    topk_values(self.unit_scores(weight.detach()), self.dense_ratio)
                )
            self.frozen = True

    def unit_mask(self, module: nn.Module) -> torch.Tensor:
        """The current 0/1 mask over units (differentiable towards the scores for ``topk``)."""
        if self.method == "topk":
            return topk_mask(getattr(module, self.scores_name), self.dense_ratio)
        mask: torch.Tensor = getattr(module, self.mask_name)
        return mask

    def kept(self, module: nn.Module) -> torch.Tensor:
        """A bool tensor over units: True where the unit survives (for ``redundancy_clean``)."""
        with torch.no_grad():
            return self.unit_mask(module).detach() > 0

    def transform(
        self, module: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        mask = self.unit_mask(module).to(weight.dtype)
        if self.prunes_bias and bias is not None:
            bias = bias * mask
        return weight * self.expand(mask, weight), bias

    def state_dict(self) -> dict[str, Any]:
        return {"active": self.active, "frozen": self.frozen}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.frozen = bool(state.get("frozen", self.frozen))
