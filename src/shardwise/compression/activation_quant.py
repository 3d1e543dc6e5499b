"""Activation quantization: the input of a matched module on ``bits`` levels.

``range_calibration`` ``"dynamic"``: every token (each row of the last dimension) gets its own
range; ``"static"``: one range, a running min/max (momentum 0.95, as DeepSpeed) updated by
training forwards and frozen in eval. Gradients pass straight through.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from shardwise.compression.layers import ModuleTechnique
from shardwise.compression.quantizers import quantize, quantize_in_range

__all__ = ["MOMENTUM", "ActivationQuantization"]

MOMENTUM = 0.95


class ActivationQuantization(ModuleTechnique):
    """Activation quantization on one module's input."""

    name = "activation_quantization"

    def __init__(
        self, shared: Mapping[str, Any], params: Mapping[str, Any], key: str, module: nn.Module
    ) -> None:
        super().__init__(int(shared["schedule_offset"]))
        self.bits = int(params["bits"])
        self.symmetric = shared["quantization_type"] == "symmetric"
        self.static = shared["range_calibration"] == "static"
        if self.static and not hasattr(module, "activation_range"):
            weight: torch.Tensor = module.weight  # type: ignore[assignment]
            module.register_buffer("activation_range", torch.full((2,), float("nan"), device=weight.device))

    def transform_input(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if not x.is_floating_point():
            return x
        if not self.static:
            return quantize(x, self.bits, x.numel() // x.shape[-1], self.symmetric)
        bounds: torch.Tensor = module.activation_range  # type: ignore[assignment]
        if module.training:
            with torch.no_grad():
                seen = torch.stack([x.detach().min(), x.detach().max()]).to(bounds.dtype)
                if torch.isnan(bounds).any():
                    bounds.copy_(seen)
                else:
                    bounds.mul_(MOMENTUM).add_(seen, alpha=1.0 - MOMENTUM)
        if torch.isnan(bounds).any():  # eval before any training forward: calibrate on this input
            return quantize(x, self.bits, 1, self.symmetric)
        return quantize_in_range(x, self.bits, bounds[0], bounds[1], self.symmetric)
