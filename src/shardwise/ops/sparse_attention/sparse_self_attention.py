"""``SparseSelfAttention``: attention computed on a sparsity layout's blocks only (DeepSpeed's API).

The layout is made once for ``max_seq_length`` (``master_layout``; not a buffer: it is rebuilt
from the config and its seed on every rank) and sliced to shorter sequences, as DeepSpeed does; the
gather plan of each sequence length is cached. Masks follow DeepSpeed's modes: ``"add"`` adds
the mask to the scaled scores, ``"mul"`` drops the scores where the mask is 0. With
``attention="unidirectional"`` the module also applies the causal triangle inside the diagonal
blocks (DeepSpeed left that to an ``attn_mask``), so a unidirectional layout is autoregressive.
The attention runs in chunks of query rows that are recomputed in backward
(:mod:`.chunked_block_sparse`), so its extra memory is about ``chunk_bytes``, not the layout's size.
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.ops.sparse_attention.block_plan import BlockPlan, build_block_plan
from shardwise.ops.sparse_attention.chunked_block_sparse import CHUNK_BYTES, sparse_attention
from shardwise.ops.sparse_attention.sparsity_config import FixedSparsityConfig, SparsityConfig

MASK_MODES = ("add", "mul")


def mask_as_bias(mask: torch.Tensor, mode: str, dtype: torch.dtype) -> torch.Tensor:
    """A mask as an additive bias: ``add`` as is; ``mul``: 0 -> ``-inf``, anything else -> 0."""
    if mode == "add":
        return mask.to(dtype)
    zeros = torch.zeros((), dtype=dtype, device=mask.device)
    return torch.where(mask == 0, torch.tensor(float("-inf"), dtype=dtype, device=mask.device), zeros)


class SparseSelfAttention(nn.Module):
    """Block-sparse self-attention over ``(batch, heads, seq, head_dim)`` query/key/value.

    Args:
        sparsity_config: the layout (default: ``FixedSparsityConfig(num_heads=4)``).
        key_padding_mask_mode: ``"add"`` or ``"mul"`` for ``key_padding_mask``.
        attn_mask_mode: ``"add"`` or ``"mul"`` for ``attn_mask``.
        max_seq_length: the longest sequence; the layout is made for it and sliced.
        chunk_bytes: the working-set budget of one chunk of query rows: attention runs in chunks
            and recomputes them in backward, so its extra memory is about this
            (:mod:`.chunked_block_sparse`).

    Example:
        >>> import torch
        >>> from shardwise.ops.sparse_attention import BigBirdSparsityConfig, SparseSelfAttention
        >>> attn = SparseSelfAttention(BigBirdSparsityConfig(num_heads=2, block=4), max_seq_length=32)
        >>> q = k = v = torch.randn(1, 2, 32, 8)
        >>> attn(q, k, v).shape
        torch.Size([1, 2, 32, 8])
    """

    def __init__(
        self,
        sparsity_config: SparsityConfig | None = None,
        key_padding_mask_mode: str = "add",
        attn_mask_mode: str = "mul",
        max_seq_length: int = 2048,
        chunk_bytes: int = CHUNK_BYTES,
    ) -> None:
        super().__init__()
        for name, mode in (
            ("key_padding_mask_mode", key_padding_mask_mode),
            ("attn_mask_mode", attn_mask_mode),
        ):
            if mode not in MASK_MODES:
                raise ValueError(f"{name}={mode!r}: use 'add' or 'mul'")
        self.sparsity_config = sparsity_config if sparsity_config is not None else FixedSparsityConfig(4)
        self.key_padding_mask_mode = key_padding_mask_mode
        self.attn_mask_mode = attn_mask_mode
        self.max_seq_length = max_seq_length
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes={chunk_bytes}: use a positive byte budget")
        self.chunk_bytes = chunk_bytes
        # a plain attribute, not a buffer: it is rebuilt from the config and its seed on every rank
        # (no broadcast or checkpoint needed), and with heads sharing one layout it is an expanded
        # read-only view that must never be written into (an in-place buffer broadcast would)
        self.master_layout = self.sparsity_config.make_layout(max_seq_length)
        self._plans: dict[tuple[int, torch.device], BlockPlan] = {}

    @property
    def causal(self) -> bool:
        """True for a unidirectional layout: keys after their query are dropped."""
        return getattr(self.sparsity_config, "attention", "bidirectional") == "unidirectional"

    def get_layout(self, seq_len: int) -> torch.Tensor:
        """The ``(heads, nb, nb)`` layout of ``seq_len``: the master layout's top-left corner."""
        if seq_len > self.max_seq_length:
            raise ValueError(f"sequence length {seq_len} exceeds max_seq_length={self.max_seq_length}")
        num_blocks = self.sparsity_config.num_blocks(seq_len)
        return self.master_layout[..., :num_blocks, :num_blocks]

    def plan(self, seq_len: int, device: torch.device) -> BlockPlan:
        """The gather plan of ``seq_len`` on ``device`` (cached)."""
        cache_key = (seq_len, device)
        if cache_key not in self._plans:
            self._plans[cache_key] = build_block_plan(self.get_layout(seq_len).cpu()).to(device)
        return self._plans[cache_key]

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        rpe: torch.Tensor | None = None,
        key_padding_mask: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Sparse attention; returns ``(batch, heads, seq, head_dim)``.

        Args:
            query, key, value: ``(batch, heads, seq, head_dim)`` (``key`` may come transposed).
            rpe: an ``(seq, seq)`` relative position bias added to the scaled scores, or None.
            key_padding_mask: ``(batch, seq)`` (or with singleton middle dims), per ``key_padding_mask_mode``.
            attn_mask: ``(seq, seq)``, per ``attn_mask_mode``.
        """
        bsz, num_heads, seq_len, head_dim = query.shape
        if key.shape[2] != seq_len:
            key = key.transpose(-1, -2)
        if query.shape != key.shape or key.shape != value.shape:
            raise NotImplementedError("only self-attention is supported: query, key and value need one shape")
        if num_heads != self.sparsity_config.num_heads:
            raise ValueError(
                f"query has {num_heads} heads, the sparsity config {self.sparsity_config.num_heads}"
            )
        dtype = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
        key_bias = None
        if key_padding_mask is not None:
            key_bias = mask_as_bias(key_padding_mask.reshape(bsz, seq_len), self.key_padding_mask_mode, dtype)
        pair_bias = None
        if attn_mask is not None:
            pair_bias = mask_as_bias(attn_mask.reshape(seq_len, seq_len), self.attn_mask_mode, dtype)
        if rpe is not None:
            rpe = rpe.reshape(seq_len, seq_len).to(dtype)
            pair_bias = rpe if pair_bias is None else pair_bias + rpe
        return sparse_attention(
            query,
            key,
            value,
            self.plan(seq_len, query.device),
            self.sparsity_config.block,
            float(head_dim) ** -0.5,
            key_bias,
            pair_bias,
            self.causal,
            self.chunk_bytes,
        )
