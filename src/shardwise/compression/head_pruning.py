"""Head pruning: the input columns of an attention output ``Linear`` that belong to a head.

The ``num_heads`` heads split the input features into equal blocks; a head's score is learned
(method ``topk``), initialised from the L1 norm of its block. ``redundancy_clean`` removes the
pruned heads' input columns here and the matching output rows (and bias entries) of the related
query/key/value linears. The attention code must derive its head count from the projection
widths (or be updated by the caller) once heads are removed.
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.compression.structured import StructuredPruning
from shardwise.config.errors import ConfigError

__all__ = ["HeadPruning"]


class HeadPruning(StructuredPruning):
    """Head pruning on one attention output ``Linear``."""

    name = "head_pruning"

    def __init__(self, shared, params, key, module) -> None:
        self.num_heads = int(shared["num_heads"])
        super().__init__(shared, params, key, module)

    def check_module(self, module: nn.Module) -> None:
        if not isinstance(module, nn.Linear) or module.in_features % self.num_heads:
            raise ConfigError(
                f"{self.key.split('.different_groups')[0]}.shared_parameters.num_heads",
                f"head pruning needs a Linear whose input width divides into {self.num_heads} heads; "
                f"a pattern matched {module}",
                "match only the attention output projection, with the model's head count",
                self.num_heads,
            )

    def unit_scores(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.abs().reshape(weight.shape[0], self.num_heads, -1).sum(dim=(0, 2))

    def expand(self, mask: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return mask.repeat_interleave(weight.shape[1] // self.num_heads).view(1, -1)
