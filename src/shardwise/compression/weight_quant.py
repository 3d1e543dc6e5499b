"""Weight quantization from ``schedule_offset``, as DeepSpeed's two paths do it.

``quantize_weight_in_forward`` true (DeepSpeed's compression layers): the forward uses the
weights quantized to ``target_bits``. False (the default; DeepSpeed quantized the fp16 weights
inside its optimizer, MoQ-style): the width starts at ``start_bits`` and drops by one bit once
``quantization_period`` steps of quantization have passed, the period doubling after each drop
(drops after P, 2P, 4P, ... steps) until ``target_bits``; here that schedule is applied in the
forward too, so the optimizer keeps full-precision weights and gradients pass straight through.
With ``fp16_mixed_quantize`` the forward uses ``r * w + (1 - r) * q(w)`` where ``r`` starts at 1
and falls by ``quantize_change_ratio`` every step (back to 1 when the width drops). Embeddings
are quantized per row (token-wise), other weights in ``quantize_groups`` groups. The schedule is
a function of the step count, so a resume continues it exactly; ``redundancy_clean`` bakes the
quantized values. ``quantizer_kernel`` (DeepSpeed's CUDA kernel) selects this same path.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from shardwise.compression.layers import ModuleTechnique
from shardwise.compression.quantizers import quantize
from shardwise.config.errors import ConfigError

__all__ = ["WeightQuantization", "bits_at"]


def bits_at(quant_steps: int, start_bits: int, target_bits: int, period: int) -> tuple[int, int]:
    """``(bits, step of the last drop)`` after ``quant_steps`` steps of quantization.

    Example:
        >>> [bits_at(s, 8, 4, 10)[0] for s in (0, 9, 10, 19, 20, 40, 80, 1000)]
        [8, 8, 7, 7, 6, 5, 4, 4]
        >>> [bits_at(s, 8, 6, 0)[0] for s in (0, 1, 2)]
        [7, 6, 6]
    """
    if period == 0:  # DeepSpeed's quantizer then drops a bit at every step, the first one included
        bits = max(target_bits, start_bits - (quant_steps + 1))
        return bits, min(quant_steps, start_bits - bits - 1) if bits < start_bits else 0
    bits, next_drop, last = start_bits, period, 0
    while bits > target_bits and quant_steps >= next_drop:
        bits, last, next_drop = bits - 1, next_drop, next_drop * 2
    return bits, last


class WeightQuantization(ModuleTechnique):
    """Weight quantization on one module (see the module docstring)."""

    name = "weight_quantization"

    def __init__(
        self, shared: Mapping[str, Any], params: Mapping[str, Any], key: str, module: nn.Module
    ) -> None:
        super().__init__(int(shared["schedule_offset"]))
        self.start_bits, self.target_bits = int(params["start_bits"]), int(params["target_bits"])
        self.period = int(params["quantization_period"])
        self.in_forward = bool(shared["quantize_weight_in_forward"])
        self.groups = (
            module.weight.shape[0] if isinstance(module, nn.Embedding) else int(shared["quantize_groups"])
        )
        self.symmetric = shared["quantization_type"] == "symmetric"
        self.stochastic = shared["rounding"] == "stochastic"
        mixed = shared["fp16_mixed_quantize"]
        self.mixed = bool(mixed["enabled"])
        self.change_ratio = float(mixed["quantize_change_ratio"])
        self.bits = self.target_bits if self.in_forward else self.start_bits
        self.real_ratio = 1.0
        weight: torch.Tensor = module.weight  # type: ignore[assignment]
        if weight.numel() % self.groups:
            raise ConfigError(
                f"{key.rsplit('.different_groups', 1)[0]}.shared_parameters.quantize_groups",
                f"must divide the {weight.numel()} weights of every matched module",
                "pick a divisor of the weight count (e.g. the number of output rows)",
                self.groups,
            )

    def update(self, module: nn.Module, step: int) -> None:
        super().update(module, step)
        steps = max(0, step - self.schedule_offset)
        if self.in_forward:
            self.bits, last_drop = self.target_bits, 0
        else:
            self.bits, last_drop = bits_at(steps, self.start_bits, self.target_bits, self.period)
        self.real_ratio = max(0.0, 1.0 - self.change_ratio * (steps - last_drop)) if self.mixed else 0.0

    def transform(
        self, module: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        q = quantize(weight, self.bits, self.groups, self.symmetric, self.stochastic)
        if self.mixed and self.real_ratio > 0:
            q = self.real_ratio * weight + (1.0 - self.real_ratio) * q
        return q, bias

    def state_dict(self) -> dict[str, Any]:
        return {"active": self.active, "bits": self.bits, "real_ratio": self.real_ratio}
