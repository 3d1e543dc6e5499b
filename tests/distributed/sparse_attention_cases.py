"""Per-rank scenario for test_sparse_attention_training.py (module level so the harness can pickle it)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

import shardwise
from shardwise.ops.sparse_attention import BertSparseSelfAttention, sparse_attention_from_config

VOCAB, HIDDEN, HEADS, SEQ = 32, 16, 2, 64


class TinySparseBert(nn.Module):
    """Embeddings, two encoder layers whose self-attention is BertSparseSelfAttention, a token head."""

    def __init__(self, make_attention: Any) -> None:
        super().__init__()
        config = SimpleNamespace(hidden_size=HIDDEN, num_attention_heads=HEADS, max_position_embeddings=SEQ)
        self.tokens = nn.Embedding(VOCAB, HIDDEN)
        self.positions = nn.Embedding(SEQ, HIDDEN)
        self.attention = nn.ModuleList()
        self.feed_forward = nn.ModuleList()
        for _ in range(2):
            layer = BertSparseSelfAttention(config, max_seq_length=SEQ)
            layer.sparse_self_attention = make_attention()  # the one the ds_config describes
            self.attention.append(layer)
            self.feed_forward.append(
                nn.Sequential(nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, HIDDEN), nn.GELU())
            )
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        x = self.tokens(ids) + self.positions.weight[None, : ids.shape[1]]
        for attention, feed_forward in zip(self.attention, self.feed_forward, strict=True):
            x = x + attention(x, padding)
            x = x + feed_forward(x)
        logits = self.head(x)
        keep = padding == 0
        return nn.functional.cross_entropy(logits[keep], labels[keep])


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
    labels = ids  # recover each token through the encoder (learnable in a few steps)
    padding = torch.zeros(2, SEQ)
    padding[1, -8:] = -10000.0  # the second sequence is padded (BERT's additive mask)
    return ids, labels, padding


def train_sparse_bert(rank: int, world: int, mode: str) -> dict[str, Any]:
    """ZeRO 2 on ``world`` gloo ranks: losses fall, parameters agree across ranks."""
    torch.set_num_threads(1)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 2000},
        "sparse_attention": {
            "mode": mode,
            "block": 8,
            "num_random_blocks": 1,
            "num_sliding_window_blocks": 3,
        },
    }
    torch.manual_seed(0)
    model = TinySparseBert(lambda: sparse_attention_from_config(cfg, HEADS, SEQ))
    query_before = model.attention[0].query.weight.detach().clone()
    engine, _, _, _ = shardwise.initialize(model=model, config=cfg)
    builder = engine.sparse_attention
    built = builder.self_attention(HEADS, SEQ) if builder is not None else None
    losses = []
    for step in range(25):
        loss = engine(*_batch(step, rank))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    flat = torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()])
    return {
        "losses": losses,
        "query_moved": not torch.equal(engine.module.attention[0].query.weight.detach(), query_before),
        "params": flat.tolist(),
        "attention": type(engine.module.attention[0].sparse_self_attention.sparsity_config).__name__,
        "built": type(built.sparsity_config).__name__ if built is not None else None,
        "ignored": [item.message for item in engine.config.ignored],
    }
