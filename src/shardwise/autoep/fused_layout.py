"""Which way round a model stores its fused gate/up expert projection (``deepspeed.moe.fused_expert_layout``).

A family without a separate up projection (``expert_w3`` None) keeps gate and up in one 3-D tensor
``w1`` next to the down projection ``w2``. Two layouts exist in the wild:

- ``"gate_up_first"``: ``w1 [E, 2F, H]``, ``w2 [E, H, F]`` (transformers 5's Mixtral, Qwen3-MoE, ...),
  the shape of :class:`~shardwise.autoep.experts.GroupedExperts`: no transpose;
- ``"hidden_first"``: ``w1 [E, H, 2F]``, ``w2 [E, F, H]`` (weights stored as ``x @ W``): transposed.

:func:`classify_fused_gate_up_layout` tells them apart from the shapes alone (the one place that does;
detection and repacking both ask it), :func:`split_fused_gate_up` cuts a pair into ``w1``/``w2``/``w3``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from torch import Tensor

__all__ = ["FusedExpertLayout", "FusedLayout", "classify_fused_gate_up_layout", "split_fused_gate_up"]

FusedLayout = Literal["gate_up_first", "hidden_first"]


@dataclass(frozen=True)
class FusedExpertLayout:
    """A recognised fused pair: its layout, the model's hidden and expert FFN sizes, and whether the
    tensors must be transposed into ``[E, F, H]`` / ``[E, H, F]``."""

    layout: FusedLayout
    hidden_size: int
    ffn_hidden_size: int
    needs_transpose: bool


def classify_fused_gate_up_layout(w1_shape: Sequence[int], w2_shape: Sequence[int]) -> FusedExpertLayout | None:
    """The layout of a fused gate/up tensor of shape ``w1_shape`` beside a down projection of shape
    ``w2_shape``, or None when the pair is neither layout (not 3-D, different expert counts, an odd
    fused dimension, or sizes that do not pair up).

    Example:
        >>> classify_fused_gate_up_layout((8, 256, 64), (8, 64, 128)).layout
        'gate_up_first'
        >>> classify_fused_gate_up_layout((8, 64, 256), (8, 128, 64)).hidden_size
        64
    """
    w1, w2 = tuple(int(n) for n in w1_shape), tuple(int(n) for n in w2_shape)
    if len(w1) != 3 or len(w2) != 3 or w1[0] != w2[0]:
        return None
    rows, cols = w1[1], w1[2]
    down = w2[1:]
    if rows % 2 == 0 and down == (cols, rows // 2):  # [E, 2F, H] beside [E, H, F]
        return FusedExpertLayout("gate_up_first", hidden_size=cols, ffn_hidden_size=rows // 2, needs_transpose=False)
    if cols % 2 == 0 and down == (cols // 2, rows):  # [E, H, 2F] beside [E, F, H]
        return FusedExpertLayout("hidden_first", hidden_size=rows, ffn_hidden_size=cols // 2, needs_transpose=True)
    return None


def split_fused_gate_up(fused: Tensor, down: Tensor, where: str = "fused experts") -> tuple[Tensor, Tensor, Tensor]:
    """``w1`` (gate) ``[E, F, H]``, ``w2`` (down) ``[E, H, F]`` and ``w3`` (up) ``[E, F, H]`` cut from a
    fused gate/up tensor and its down projection in either layout (gate is the first half); new
    contiguous tensors.

    Raises:
        ValueError: the shapes are neither layout (named with ``where``).
    """
    layout = classify_fused_gate_up_layout(fused.shape, down.shape)
    if layout is None:
        raise ValueError(
            f"{where}: fused gate/up weight {tuple(fused.shape)} beside down projection {tuple(down.shape)}; "
            "rule: [E, 2F, H] with [E, H, F] or [E, H, 2F] with [E, F, H]; fix: name the separate up "
            "projection in expert_parallel.expert_w3, or use a preset that describes the model"
        )
    ffn = layout.ffn_hidden_size
    if layout.needs_transpose:
        fused, down = fused.transpose(1, 2), down.transpose(1, 2)
    return fused[:, :ffn].contiguous(), down.contiguous(), fused[:, ffn:].contiguous()
