"""The ``sparse_attention`` section -> a sparsity config or a ``SparseSelfAttention``.

Every check that DeepSpeed made inside its layout classes is made here first, against the
section's keys, so a mistake becomes a :class:`~shardwise.config.errors.ConfigError` naming the
key, the value, the rule and a fix (a layout that cannot be built for ``max_seq_length``:
sequence not a multiple of the block, global indices past the last block, windows wider than
the sequence...). The section's keys map to the classes as in DeepSpeed's ``get_sparse_attention``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from shardwise.config.errors import ConfigError
from shardwise.config.resolve import ResolvedConfig, load_config
from shardwise.config.sections.legacy import SparseAttentionConfig
from shardwise.ops.sparse_attention.sparse_self_attention import SparseSelfAttention
from shardwise.ops.sparse_attention.sparsity_config import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    SparsityConfig,
    VariableSparsityConfig,
)

_KEY = "sparse_attention"
ConfigSource = SparseAttentionConfig | ResolvedConfig | Mapping[str, Any] | str | os.PathLike[str]


def _section_of(config: ConfigSource) -> SparseAttentionConfig:
    if isinstance(config, SparseAttentionConfig):
        return config
    resolved = config if isinstance(config, ResolvedConfig) else load_config(config)
    section = resolved.config.sparse_attention
    if section is None:
        raise ConfigError(
            _KEY, "the config has no sparse_attention section", 'add {"sparse_attention": {"mode": "fixed"}}'
        )
    return section


def _fail(key: str, value: object, rule: str, fix: str) -> ConfigError:
    return ConfigError(f"{_KEY}.{key}", rule, fix, value=value)


def _check_globals(s: SparseAttentionConfig, num_blocks: int) -> None:
    for index in s.global_block_indices:
        if not 0 <= index < num_blocks:
            raise _fail(
                "global_block_indices",
                s.global_block_indices,
                f"index {index} is outside the {num_blocks} blocks of max_seq_length",
                f"use block indices in 0..{num_blocks - 1}",
            )
    ends = s.global_block_end_indices
    if ends is None:
        return
    if len(ends) != len(s.global_block_indices):
        raise _fail(
            "global_block_end_indices",
            ends,
            f"needs one end per global_block_indices entry ({len(s.global_block_indices)})",
            "give as many ends as starts, or drop global_block_end_indices",
        )
    for start, end in zip(s.global_block_indices, ends, strict=True):
        if not start < end <= num_blocks:
            raise _fail(
                "global_block_end_indices",
                ends,
                f"end {end} must be after its start {start} and at most {num_blocks} (the block count)",
                "use half-open ranges start < end <= number of blocks",
            )


def _check(s: SparseAttentionConfig, max_seq_length: int) -> None:
    if max_seq_length % s.block != 0:
        raise _fail(
            "block",
            s.block,
            f"max_seq_length {max_seq_length} is not a multiple of the block",
            "choose a block that divides the sequence length, or pad inputs with"
            " SparseAttentionUtils.pad_to_block_size",
        )
    num_blocks = max_seq_length // s.block
    uses = {
        "fixed": ("num_local_blocks", "num_global_blocks", "horizontal"),
        "variable": ("num_random_blocks", "globals", "horizontal", "local_window_blocks"),
        "bigbird": ("num_random_blocks", "num_sliding_window_blocks", "num_global_blocks"),
        "bslongformer": ("num_sliding_window_blocks", "globals"),
        "dense": (),
    }[s.mode]
    for key in ("num_random_blocks", "num_sliding_window_blocks", "num_global_blocks", "num_local_blocks"):
        if key in uses and getattr(s, key) > num_blocks:
            raise _fail(
                key, getattr(s, key), f"exceeds the {num_blocks} blocks of max_seq_length", "lower it"
            )
    if "horizontal" in uses and s.horizontal_global_attention and s.attention != "bidirectional":
        raise _fail(
            "horizontal_global_attention",
            True,
            "needs attention 'bidirectional'",
            "set it false or go bidirectional",
        )
    if "globals" in uses:
        _check_globals(s, num_blocks)
    if "local_window_blocks" in uses and (not s.local_window_blocks or min(s.local_window_blocks) < 1):
        raise _fail(
            "local_window_blocks", s.local_window_blocks, "window sizes must be positive", "use e.g. [4]"
        )
    if s.mode == "fixed":
        if s.num_global_blocks < 1 or s.num_local_blocks % s.num_global_blocks != 0:
            raise _fail(
                "num_global_blocks",
                s.num_global_blocks,
                f"must divide num_local_blocks ({s.num_local_blocks})",
                "pick a divisor of num_local_blocks",
            )
        patterns = s.num_different_global_patterns
        if patterns > 1 and not s.different_layout_per_head:
            raise _fail(
                "num_different_global_patterns",
                patterns,
                "several patterns need one layout per head",
                "set different_layout_per_head true, or the patterns to 1",
            )
        if patterns > s.num_local_blocks // s.num_global_blocks:
            raise _fail(
                "num_different_global_patterns",
                patterns,
                f"at most num_local_blocks / num_global_blocks = {s.num_local_blocks // s.num_global_blocks}",
                "lower it",
            )


def sparsity_config_from_section(
    section: SparseAttentionConfig, num_heads: int, max_seq_length: int, seed: int = 0
) -> SparsityConfig:
    """The layout class of ``section.mode``, checked against ``max_seq_length`` (ConfigError if it cannot be built)."""
    _check(section, max_seq_length)
    s = section
    common: dict[str, Any] = {"block": s.block, "different_layout_per_head": s.different_layout_per_head}
    if s.mode == "dense":
        return DenseSparsityConfig(num_heads, seed=seed, **common)
    if s.mode == "fixed":
        return FixedSparsityConfig(
            num_heads,
            num_local_blocks=s.num_local_blocks,
            num_global_blocks=s.num_global_blocks,
            attention=s.attention,
            horizontal_global_attention=s.horizontal_global_attention,
            num_different_global_patterns=s.num_different_global_patterns,
            seed=seed,
            **common,
        )
    if s.mode == "variable":
        return VariableSparsityConfig(
            num_heads,
            num_random_blocks=s.num_random_blocks,
            local_window_blocks=s.local_window_blocks,
            global_block_indices=s.global_block_indices,
            global_block_end_indices=s.global_block_end_indices,
            attention=s.attention,
            horizontal_global_attention=s.horizontal_global_attention,
            seed=seed,
            **common,
        )
    if s.mode == "bigbird":
        return BigBirdSparsityConfig(
            num_heads,
            num_random_blocks=s.num_random_blocks,
            num_sliding_window_blocks=s.num_sliding_window_blocks,
            num_global_blocks=s.num_global_blocks,
            attention=s.attention,
            seed=seed,
            **common,
        )
    return BSLongformerSparsityConfig(
        num_heads,
        num_sliding_window_blocks=s.num_sliding_window_blocks,
        global_block_indices=s.global_block_indices,
        global_block_end_indices=s.global_block_end_indices,
        attention=s.attention,
        seed=seed,
        **common,
    )


def sparse_attention_from_config(
    config: ConfigSource,
    num_heads: int,
    max_seq_length: int,
    *,
    key_padding_mask_mode: str = "add",
    attn_mask_mode: str = "mul",
    seed: int = 0,
) -> SparseSelfAttention:
    """A :class:`SparseSelfAttention` from a config's ``sparse_attention`` section.

    Args:
        config: the section, a resolved config (``engine.config``), or a ds_config path/dict.
        num_heads: attention heads of the layer.
        max_seq_length: the longest sequence; the layout is checked and made for it.
        key_padding_mask_mode, attn_mask_mode: ``"add"`` or ``"mul"`` (DeepSpeed's defaults).
        seed: seeds the random blocks; use the same seed on every rank.

    Example:
        >>> attn = sparse_attention_from_config({"train_batch_size": 1, "sparse_attention": {"mode": "bigbird",
        ...     "block": 16, "num_random_blocks": 1}}, num_heads=4, max_seq_length=256)
        >>> type(attn.sparsity_config).__name__
        'BigBirdSparsityConfig'
    """
    sparsity = sparsity_config_from_section(_section_of(config), num_heads, max_seq_length, seed)
    return SparseSelfAttention(sparsity, key_padding_mask_mode, attn_mask_mode, max_seq_length)


class SparseAttentionBuilder:
    """A config's ``sparse_attention`` section, ready to build layers (``engine.sparse_attention``).

    Example:
        >>> from shardwise.config.sections.legacy import SparseAttentionConfig
        >>> builder = SparseAttentionBuilder(SparseAttentionConfig(mode="fixed", block=16))
        >>> builder.self_attention(num_heads=4, max_seq_length=128).sparsity_config.num_local_blocks
        4
    """

    def __init__(self, section: SparseAttentionConfig) -> None:
        self.section = section

    def sparsity_config(self, num_heads: int, max_seq_length: int, seed: int = 0) -> SparsityConfig:
        """The layout class of the section's mode (ConfigError if it cannot be built for ``max_seq_length``)."""
        return sparsity_config_from_section(self.section, num_heads, max_seq_length, seed)

    def self_attention(self, num_heads: int, max_seq_length: int, **kwargs: Any) -> SparseSelfAttention:
        """A :class:`SparseSelfAttention`; ``kwargs`` as in :func:`sparse_attention_from_config`."""
        return sparse_attention_from_config(self.section, num_heads, max_seq_length, **kwargs)
