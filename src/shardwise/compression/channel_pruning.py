"""Channel pruning: whole output channels of a ``Conv2d`` (filter and bias), scored by L1 norm.

Meant for the first of two back-to-back convolutions: ``redundancy_clean`` removes the pruned
channels, the matching input channels of a related ``Conv2d`` and the matching features of a
related ``BatchNorm2d``.
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.compression.structured import StructuredPruning
from shardwise.config.errors import ConfigError

__all__ = ["ChannelPruning"]


class ChannelPruning(StructuredPruning):
    """Channel pruning on one ``Conv2d``."""

    name = "channel_pruning"
    prunes_bias = True

    def check_module(self, module: nn.Module) -> None:
        if not isinstance(module, nn.Conv2d):
            raise ConfigError(
                f"{self.key}.modules",
                f"channel pruning acts on Conv2d modules; a pattern matched a {type(module).__name__}",
                "narrow the pattern (use row_pruning for Linear)",
            )
        if module.groups != 1:
            raise ConfigError(
                f"{self.key}.modules",
                f"channel pruning needs groups=1 convolutions; this one has groups={module.groups}",
                "exclude grouped/depthwise convolutions",
            )

    def unit_scores(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.abs().sum(dim=(1, 2, 3))

    def expand(self, mask: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return mask.view(-1, 1, 1, 1)
