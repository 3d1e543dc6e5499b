"""TinyGPT as a PipelineModule (tests, docs and the pipeline benchmark).

The layers are those of :class:`~shardwise.testing.models.TinyGPT`: an embedding layer (token and
position tables), the blocks, the final norm and an LM head tied to the token table through a
``TiedLayerSpec`` (Megatron-DeepSpeed's pattern). :func:`state_from_gpt` maps a TinyGPT's
``state_dict`` onto the pipeline's parameter names, so a pipelined run can start from, and be
compared with, an unpipelined one.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.testing.models import Block, GPTConfig


class EmbeddingPipe(nn.Module):
    """Token + position embeddings: ``idx -> x``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))


def lm_head(embedding: EmbeddingPipe, x: torch.Tensor) -> torch.Tensor:
    """The tied LM head: logits from the token table."""
    return x @ embedding.wte.weight.t()


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """TinyGPT's loss: mean cross-entropy in fp32."""
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))


def gpt_layers(cfg: GPTConfig) -> list[Any]:
    """The layer specs of a pipelined TinyGPT (``n_layer + 3`` layers)."""
    from shardwise.pipe import LayerSpec, TiedLayerSpec

    return [
        TiedLayerSpec("embed", EmbeddingPipe, cfg, tied_weight_attr="wte.weight"),
        *[LayerSpec(Block, cfg) for _ in range(cfg.n_layer)],
        LayerSpec(nn.LayerNorm, cfg.n_embd),
        TiedLayerSpec("embed", EmbeddingPipe, cfg, forward_fn=lm_head, tied_weight_attr="wte.weight"),
    ]


def pipe_name_to_gpt(name: str, n_layer: int) -> str:
    """The TinyGPT parameter a pipeline parameter name stands for."""
    if name.startswith("tied_modules.embed."):
        return name[len("tied_modules.embed.") :]
    index, _, rest = name.partition(".")
    layer = int(index)
    if 1 <= layer <= n_layer:
        return f"blocks.{layer - 1}.{rest}"
    if layer == n_layer + 1:
        return f"ln_f.{rest}"
    raise KeyError(name)


def state_from_gpt(pipe: nn.Module, gpt_state: dict[str, torch.Tensor], n_layer: int) -> None:
    """Copy a TinyGPT state dict into this stage's parameters (every tied copy too)."""
    with torch.no_grad():
        for name, p in pipe.named_parameters():
            p.copy_(gpt_state[pipe_name_to_gpt(name, n_layer)])
