"""The ``sparse_attention`` section builds the layouts; impossible layouts are ConfigErrors naming the key."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from shardwise.config import load_config
from shardwise.config.errors import ConfigError
from shardwise.config.sections.legacy import SparseAttentionConfig
from shardwise.ops.sparse_attention import (
    BertSparseSelfAttention,
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    SparseAttentionBuilder,
    SparseAttentionUtils,
    VariableSparsityConfig,
    sparse_attention_from_config,
)

BASE: dict[str, Any] = {"train_batch_size": 2}


def _section(**keys: Any) -> SparseAttentionConfig:
    return load_config({**BASE, "sparse_attention": keys}).config.sparse_attention  # type: ignore[return-value]


@pytest.mark.parametrize(
    ("mode", "cls"),
    [
        ("dense", DenseSparsityConfig),
        ("fixed", FixedSparsityConfig),
        ("variable", VariableSparsityConfig),
        ("bigbird", BigBirdSparsityConfig),
        ("bslongformer", BSLongformerSparsityConfig),
    ],
)
def test_each_mode_builds_its_layout_class_with_the_sections_values(mode: str, cls: type) -> None:
    attn = sparse_attention_from_config({**BASE, "sparse_attention": {"mode": mode, "block": 8}}, 4, 128)
    assert type(attn.sparsity_config) is cls
    assert attn.sparsity_config.block == 8 and attn.sparsity_config.num_heads == 4
    assert attn.master_layout.shape == (4, 16, 16)


def test_section_values_reach_the_layout() -> None:
    section = _section(
        mode="bigbird", block=16, num_random_blocks=2, num_sliding_window_blocks=5, attention="unidirectional"
    )
    cfg = SparseAttentionBuilder(section).sparsity_config(num_heads=2, max_seq_length=256, seed=3)
    assert isinstance(cfg, BigBirdSparsityConfig)
    assert (cfg.num_random_blocks, cfg.num_sliding_window_blocks, cfg.attention, cfg.seed) == (
        2,
        5,
        "unidirectional",
        3,
    )
    fixed = SparseAttentionBuilder(
        _section(mode="fixed", num_local_blocks=8, num_global_blocks=2, horizontal_global_attention=True)
    ).self_attention(num_heads=2, max_seq_length=256, attn_mask_mode="add")
    assert fixed.attn_mask_mode == "add"
    assert (fixed.sparsity_config.num_local_blocks, fixed.sparsity_config.num_global_blocks) == (8, 2)


@pytest.mark.parametrize(
    ("keys", "seq", "bad_key", "words"),
    [
        ({"mode": "fixed", "block": 16}, 100, "sparse_attention.block", "not a multiple of the block"),
        (
            {"mode": "bslongformer", "global_block_indices": [0, 9]},
            128,
            "sparse_attention.global_block_indices",
            "outside the 8 blocks",
        ),
        (
            {"mode": "variable", "global_block_indices": [0, 2], "global_block_end_indices": [1]},
            128,
            "sparse_attention.global_block_end_indices",
            "one end per",
        ),
        (
            {"mode": "variable", "global_block_indices": [2], "global_block_end_indices": [2]},
            128,
            "sparse_attention.global_block_end_indices",
            "after its start",
        ),
        (
            {"mode": "bigbird", "num_sliding_window_blocks": 9},
            128,
            "sparse_attention.num_sliding_window_blocks",
            "exceeds",
        ),
        ({"mode": "bigbird", "num_random_blocks": 9}, 128, "sparse_attention.num_random_blocks", "exceeds"),
        ({"mode": "fixed", "num_global_blocks": 3}, 128, "sparse_attention.num_global_blocks", "divide"),
        (
            {"mode": "fixed", "num_different_global_patterns": 2},
            128,
            "sparse_attention.num_different_global_patterns",
            "one layout per head",
        ),
        (
            {"mode": "variable", "attention": "unidirectional", "horizontal_global_attention": True},
            128,
            "sparse_attention.horizontal_global_attention",
            "bidirectional",
        ),
    ],
)
def test_layouts_that_cannot_be_built_name_the_key_and_a_fix(
    keys: dict[str, Any], seq: int, bad_key: str, words: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        sparse_attention_from_config({**BASE, "sparse_attention": keys}, num_heads=2, max_seq_length=seq)
    assert caught.value.key == bad_key and words in str(caught.value) and caught.value.fix


def test_a_config_without_the_section_says_how_to_add_it() -> None:
    with pytest.raises(ConfigError) as caught:
        sparse_attention_from_config(BASE, num_heads=2, max_seq_length=64)
    assert caught.value.key == "sparse_attention" and "mode" in caught.value.fix


def test_the_section_is_no_longer_reported_as_ignored() -> None:
    cfg = load_config({**BASE, "sparse_attention": {"mode": "bigbird"}}, strict=True)
    assert not [item for item in cfg.ignored if "sparse_attention" in item.message]


# ---------------------------------------------------------------------------- SparseAttentionUtils
def test_pad_to_block_size_and_unpad() -> None:
    ids = torch.arange(10).reshape(2, 5)
    mask = torch.ones(2, 5, dtype=torch.long)
    types = torch.zeros(2, 5, dtype=torch.long)
    pad, ids2, mask2, types2, pos2, emb2 = SparseAttentionUtils.pad_to_block_size(
        4, ids, mask, types, None, None, pad_token_id=99, model_embeddings=None
    )
    assert pad == 3 and ids2.shape == (2, 8) and ids2[:, 5:].eq(99).all()
    assert mask2[:, 5:].eq(0).all() and types2.shape == (2, 8) and pos2 is None and emb2 is None
    out = torch.randn(2, 8, 3)
    assert torch.equal(SparseAttentionUtils.unpad_sequence_output(pad, out), out[:, :5])
    embed = nn.Embedding(100, 3)
    pad, *_, emb = SparseAttentionUtils.pad_to_block_size(
        4, None, mask, types, None, torch.randn(2, 5, 3), 99, embed
    )
    assert emb.shape == (2, 8, 3) and torch.equal(emb[0, 5], embed.weight[99])
    assert SparseAttentionUtils.pad_to_block_size(5, ids, mask, types, None, None, 0, None)[0] == 0


def _tiny_bert(max_positions: int = 16) -> nn.Module:
    config = SimpleNamespace(hidden_size=8, num_attention_heads=2, max_position_embeddings=max_positions)

    class SelfAttention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.query, self.key, self.value = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    layers = nn.ModuleList()
    for _ in range(2):
        layer = nn.Module()
        layer.attention = nn.Module()
        layer.attention.self = SelfAttention()
        layers.append(layer)
    model = nn.Module()
    model.config = config
    model.bert = nn.Module()
    model.bert.embeddings = nn.Module()
    model.bert.embeddings.position_embeddings = nn.Embedding(max_positions, 8)
    model.bert.encoder = nn.Module()
    model.bert.encoder.layer = layers
    return model


def test_extend_position_embedding_tiles_the_table() -> None:
    model = _tiny_bert()
    old = model.bert.embeddings.position_embeddings.weight.detach().clone()
    SparseAttentionUtils.extend_position_embedding(model, 64)
    new = model.bert.embeddings.position_embeddings.weight
    assert (
        new.shape == (64, 8) and torch.equal(new[16:32], old) and model.config.max_position_embeddings == 64
    )
    with pytest.raises(ValueError, match="must exceed"):
        SparseAttentionUtils.extend_position_embedding(model, 32)
    with pytest.raises(ValueError, match=r"a \.bert or"):
        SparseAttentionUtils.extend_position_embedding(nn.Linear(1, 1), 64)


def test_replace_self_attention_keeps_the_projections() -> None:
    model = _tiny_bert()
    query = model.bert.encoder.layer[0].attention.self.query
    SparseAttentionUtils.replace_model_self_attention_with_sparse_self_attention(
        model, 32, FixedSparsityConfig(num_heads=2, block=4)
    )
    replaced = model.bert.encoder.layer[0].attention.self
    assert isinstance(replaced, BertSparseSelfAttention) and replaced.query is query
    assert replaced.sparse_self_attention.max_seq_length == 32 and model.config.max_position_embeddings == 32
    assert replaced(torch.randn(1, 32, 8), torch.zeros(1, 32)).shape == (1, 32, 8)


def test_update_tokenizer_model_max_length() -> None:
    tokenizer = SimpleNamespace(model_max_length=512, init_kwargs={})
    SparseAttentionUtils.update_tokenizer_model_max_length(tokenizer, 4096)
    assert tokenizer.model_max_length == 4096 and tokenizer.init_kwargs["model_max_length"] == 4096
