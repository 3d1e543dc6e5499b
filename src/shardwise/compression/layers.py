"""Compression-aware ``Linear``, ``Conv2d`` and ``Embedding``.

:func:`make_compressed` turns a module into its compression-aware class in place (its class
changes; its parameters, hooks and device stay, so tied weights and optimizers built later see
the same tensors). Each technique attached to it (:class:`ModuleTechnique`) transforms the
weight (and bias) in the forward while it is active: masks of the pruning techniques, then the
weight quantizer, in DeepSpeed's order; activation quantization transforms the input.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "CompressedConv2d",
    "CompressedEmbedding",
    "CompressedLinear",
    "CompressedModule",
    "ModuleTechnique",
    "make_compressed",
]

ORDER = ("weight_quantization", "sparse_pruning", "row_pruning", "head_pruning", "channel_pruning")


class ModuleTechnique:
    """One technique on one module. Subclasses override what they need.

    Attributes:
        name: the technique's config name (``"row_pruning"``).
        schedule_offset: the step from which it acts.
        active: it transforms the forward now (set by :meth:`update`).
    """

    name = ""

    def __init__(self, schedule_offset: int) -> None:
        self.schedule_offset = schedule_offset
        self.active = False

    def update(self, module: nn.Module, step: int) -> None:
        """Called by the scheduler with the number of optimizer steps taken (0 before the first)."""
        self.active = step >= self.schedule_offset

    def transform(
        self, module: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The weight and bias the forward uses (called only while active)."""
        return weight, bias

    def transform_input(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The input the forward uses (called only while active)."""
        return x

    def state_dict(self) -> dict[str, Any]:
        """Plain values to resume with (masks and scores are the module's buffers/parameters)."""
        return {"active": self.active}

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Restore :meth:`state_dict`."""
        self.active = bool(state.get("active", self.active))


class CompressedModule(nn.Module):
    """Marker base of the compression-aware modules; ``compression`` maps technique -> state."""

    compression: dict[str, ModuleTechnique]

    def compressed_weight(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The weight and bias after every active technique (what the forward multiplies by)."""
        weight: torch.Tensor = self.weight  # type: ignore[assignment]
        bias = getattr(self, "bias", None)
        for name in ORDER:
            technique = self.compression.get(name)
            if technique is not None and technique.active:
                weight, bias = technique.transform(self, weight, bias)
        return weight, bias

    def compressed_input(self, x: torch.Tensor) -> torch.Tensor:
        """The input after activation quantization (when active)."""
        technique = self.compression.get("activation_quantization")
        if technique is not None and technique.active:
            return technique.transform_input(self, x)
        return x


class CompressedLinear(nn.Linear, CompressedModule):
    """``nn.Linear`` whose forward applies the attached compression techniques."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.compressed_weight()
        return F.linear(self.compressed_input(x), weight, bias)


class CompressedConv2d(nn.Conv2d, CompressedModule):
    """``nn.Conv2d`` whose forward applies the attached compression techniques."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.compressed_weight()
        return self._conv_forward(self.compressed_input(x), weight, bias)


class CompressedEmbedding(nn.Embedding, CompressedModule):
    """``nn.Embedding`` whose lookup table is the compressed weight (weight quantization only)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, _ = self.compressed_weight()
        return F.embedding(
            x, weight, self.padding_idx, self.max_norm, self.norm_type, self.scale_grad_by_freq, self.sparse
        )


_CLASSES: dict[type[nn.Module], type[nn.Module]] = {
    nn.Linear: CompressedLinear,
    nn.Conv2d: CompressedConv2d,
    nn.Embedding: CompressedEmbedding,
}
PLAIN: dict[type[nn.Module], type[nn.Module]] = {v: k for k, v in _CLASSES.items()}


def make_compressed(module: nn.Module) -> CompressedModule:
    """Turn ``module`` (exactly ``Linear``, ``Conv2d`` or ``Embedding``) into its compression-aware
    class in place; an already compressed module is returned as it is.

    Raises:
        TypeError: another type (a subclass with its own forward is not replaced silently).
    """
    if isinstance(module, CompressedModule):
        return module
    target = _CLASSES.get(type(module))
    if target is None:
        raise TypeError(
            f"{type(module).__name__} cannot be compressed: only torch.nn.Linear, Conv2d and Embedding are"
        )
    module.__class__ = target
    module.compression = {}  # type: ignore[assignment]
    return module  # type: ignore[return-value]
