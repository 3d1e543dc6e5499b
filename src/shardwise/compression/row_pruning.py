"""Row pruning: whole output rows of a ``Linear`` (and its bias entries), scored by their L1 norm.

Meant for the first of two back-to-back linears: ``redundancy_clean`` removes the pruned rows
and the matching input columns of the ``related_modules`` (the second linear).
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.compression.structured import StructuredPruning
from shardwise.config.errors import ConfigError

__all__ = ["RowPruning"]


class RowPruning(StructuredPruning):
    """Row pruning on one ``Linear``."""

    name = "row_pruning"
    prunes_bias = True

    def check_module(self, module: nn.Module) -> None:
        if not isinstance(module, nn.Linear):
            raise ConfigError(
                f"{self.key}.modules",
                f"row pruning acts on Linear modules; a pattern matched a {type(module).__name__}",
                "narrow the pattern (use channel_pruning for Conv2d)",
            )

    def unit_scores(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.abs().sum(dim=1)

    def expand(self, mask: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return mask.view(-1, 1)
