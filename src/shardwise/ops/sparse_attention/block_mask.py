"""A sparsity layout as a FlexAttention ``BlockMask`` (``torch.nn.attention.flex_attention``).

For models that compile their attention with ``flex_attention`` (GPU, or CPU with inductor):
the mask's blocks are the layout's blocks, and its mask function keeps exactly the elements
:class:`SparseSelfAttention` keeps (the layout's blocks, cut to the lower triangle with ``causal``).
shardwise itself never compiles (see :mod:`.block_sparse`); it only builds the mask.
"""

from __future__ import annotations

from typing import Any

import torch


def layout_block_mask(layout: torch.Tensor, block: int, causal: bool = False) -> Any:
    """The ``BlockMask`` of ``layout`` ``(heads, nb, nb)`` for sequences of ``nb * block`` tokens.

    Example:
        >>> from shardwise.ops.sparse_attention import FixedSparsityConfig
        >>> cfg = FixedSparsityConfig(num_heads=2, block=16)
        >>> mask = layout_block_mask(cfg.make_layout(128), cfg.block)
        >>> mask.shape
        (1, 2, 128, 128)
    """
    from torch.nn.attention.flex_attention import BlockMask

    bool_layout = layout.bool()
    num_blocks = bool_layout.shape[-1]
    counts = bool_layout.sum(-1, dtype=torch.int32)[None]  # (1, heads, nb)
    order = torch.sort(bool_layout.to(torch.uint8), dim=-1, descending=True, stable=True).indices
    indices = order.to(torch.int32)[None]  # (1, heads, nb, nb): the attended blocks first

    # the mask function repeats the layout element-wise: eager flex_attention reads only this
    # function (it ignores the block lists); compiled, the block lists skip the empty blocks
    lookup = bool_layout.contiguous()

    def layout_mask(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        keep = lookup[h, q_idx // block, kv_idx // block]
        return keep & (q_idx >= kv_idx) if causal else keep

    length = num_blocks * block
    return BlockMask.from_kv_blocks(
        counts, indices, BLOCK_SIZE=block, mask_mod=layout_mask, seq_lengths=(length, length)
    )
