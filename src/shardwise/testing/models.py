"""Small models for tests, the demo and the benchmarks (pure torch, no shardwise imports).

``TinyGPT`` is a nanoGPT-style decoder: token + position embeddings, pre-norm blocks
(causal self-attention via ``scaled_dot_product_attention``, GELU MLP), a tied LM head.
``gpt_17m()`` is the benchmark size (about 17M parameters).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a TinyGPT."""

    vocab_size: int = 512
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    qkv_bias: bool = True  # parity tests turn it off: the key bias gets a zero (pure noise) gradient


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.qkv_bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(), nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A small GPT. ``forward(idx, targets)`` returns the mean cross-entropy loss when
    ``targets`` is given, else the logits.

    Example:
        >>> model = TinyGPT(GPTConfig(n_layer=1, n_embd=32))
        >>> loss = model(torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long))
        >>> loss.shape
        torch.Size([])
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        # ``checkpoint_fn(block, x)`` runs each block (activation checkpointing); None: plain calls
        self.checkpoint_fn: Callable[..., torch.Tensor] | None = None
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x) if self.checkpoint_fn is None else self.checkpoint_fn(block, x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))


def gpt_17m() -> GPTConfig:
    """The benchmark GPT: 8 layers, width 384, vocab 8192, context 128 (about 17.3M parameters)."""
    return GPTConfig(vocab_size=8192, block_size=128, n_layer=8, n_head=6, n_embd=384)


class TokenDataset(torch.utils.data.Dataset):
    """Deterministic random token sequences: item i is ``(x, y)`` with y = x shifted by one."""

    def __init__(self, num_samples: int, block_size: int, vocab_size: int, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, vocab_size, (num_samples, block_size + 1), generator=gen)

    def __len__(self) -> int:
        return self.data.shape[0]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = self.data[i]
        return row[:-1], row[1:]
