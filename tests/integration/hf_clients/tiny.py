"""Shared by the client scripts: a tiny GPT-2 built from a config (no hub access) and its data."""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel


def tiny_gpt2() -> GPT2LMHeadModel:
    """Two layers, 32 wide, vocabulary 64, no dropout (so a resume does not depend on dropout RNG)."""
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=64,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(config)


def token_data(rows: int = 64) -> torch.Tensor:
    """Random token ids, the same on every rank."""
    return torch.randint(0, 64, (rows, 16), generator=torch.Generator().manual_seed(0))
