"""``BertSparseSelfAttention``: a BERT self-attention layer (query/key/value projections) on sparse attention."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardwise.ops.sparse_attention.sparse_self_attention import SparseSelfAttention
from shardwise.ops.sparse_attention.sparsity_config import FixedSparsityConfig, SparsityConfig


class BertSparseSelfAttention(nn.Module):
    """Drop-in for a BERT ``SelfAttention``: projections, then :class:`SparseSelfAttention`.

    Args:
        config: an object with ``hidden_size`` and ``num_attention_heads`` (a BERT config).
        sparsity_config: the layout (default: ``FixedSparsityConfig(num_heads=4)``).
        max_seq_length: the longest sequence (default: ``config.max_position_embeddings``, else 2048).

    ``forward(hidden_states, attention_mask)`` takes the key-padding mask in the ``add`` mode
    (BERT's extended mask: 0 to keep, a large negative number to drop) and returns
    ``(batch, seq, hidden_size)``.
    """

    def __init__(
        self, config: Any, sparsity_config: SparsityConfig | None = None, max_seq_length: int | None = None
    ) -> None:
        super().__init__()
        if config.hidden_size % config.num_attention_heads != 0:
            raise ValueError(
                f"The hidden size ({config.hidden_size}) is not a multiple of the number of attention heads"
                f" ({config.num_attention_heads})"
            )
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.hidden_size // config.num_attention_heads
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.query = nn.Linear(config.hidden_size, self.all_head_size)
        self.key = nn.Linear(config.hidden_size, self.all_head_size)
        self.value = nn.Linear(config.hidden_size, self.all_head_size)
        if max_seq_length is None:
            max_seq_length = int(getattr(config, "max_position_embeddings", 2048))
        sparsity = sparsity_config if sparsity_config is not None else FixedSparsityConfig(num_heads=4)
        self.sparse_self_attention = SparseSelfAttention(sparsity, max_seq_length=max_seq_length)

    def transpose_for_scores(self, x: torch.Tensor) -> torch.Tensor:
        """``(batch, seq, hidden)`` -> ``(batch, heads, seq, head_size)``."""
        x = x.view(*x.shape[:-1], self.num_attention_heads, self.attention_head_size)
        return x.permute(0, 2, 1, 3)

    def forward(
        self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The context layer ``(batch, seq, hidden_size)``."""
        query = self.transpose_for_scores(self.query(hidden_states))
        key = self.transpose_for_scores(self.key(hidden_states))
        value = self.transpose_for_scores(self.value(hidden_states))
        context = self.sparse_self_attention(query, key, value, key_padding_mask=attention_mask)
        context = context.permute(0, 2, 1, 3).contiguous()
        return context.view(*context.shape[:-2], self.all_head_size)
