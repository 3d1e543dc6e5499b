"""A model whose gradients are exact in fp32, for test_muon_engine.py's gas=1 vs gas=4 check.

:class:`LinearProbe`'s loss is linear in every parameter and no parameter multiplies another:
``loss = mean_i <embed(token_i) + hidden(a_i) + proj(b_i), t_i>``. So each gradient is a sum over
samples of products of the data (``t_i a_i^T / N`` for ``hidden.weight``, ``t_i / N`` for the bias,
rows of ``t_i / N`` for the embedding) and never depends on the weights. The data are small
integers times a power of two (``a``, ``b`` in {-3..3}, ``t`` in {-3..3} / 8; N, the gas, and the
world size are powers of two), so every product and every partial sum of the gradient is a short
dyadic number that fp32 holds exactly, whatever the order of summation: a micro batch of 4 samples
and 4 micro batches of 1 accumulated, then averaged over 2 ranks, give the same bits, at every step,
whatever the weights have become.
"""

from __future__ import annotations

from typing import Any

import muon_cases
import torch
from torch import nn

from shardwise.optim.muon_groups import uses_muon

VOCAB, WIDTH, A, B = 16, 8, 12, 4
SAMPLES = 4  # per rank and step: gas=1 takes them as one micro batch, gas=4 one by one


class LinearProbe(nn.Module):
    """Two Muon matrices (``hidden.weight`` 8x12, ``proj.weight`` 8x4) and an AdamW half with a
    matrix (``embed_tokens``, by DeepSpeed's name rule) and a vector (``hidden.bias``)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, WIDTH)
        self.hidden = nn.Linear(A, WIDTH)
        self.proj = nn.Linear(B, WIDTH, bias=False)

    def forward(self, tokens: torch.Tensor, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        out = self.embed_tokens(tokens) + self.hidden(x[:, :A]) + self.proj(x[:, A:])
        return (out * t).sum(dim=1).mean()


def make_probe() -> LinearProbe:
    torch.manual_seed(0)
    return LinearProbe()


def samples(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s samples of ``step``: tokens, inputs (integers) and targets (eighths)."""
    gen = torch.Generator().manual_seed(100 * step + rank)
    tokens = torch.randint(0, VOCAB, (SAMPLES,), generator=gen)
    x = torch.randint(-3, 4, (SAMPLES, A + B), generator=gen).float()
    t = torch.randint(-3, 4, (SAMPLES, WIDTH), generator=gen).float() / 8
    return tokens, x, t


def train(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """``case``: stage, gas (1 or 4: micro batches of 4 // gas samples), steps, optional ``init``."""
    torch.set_num_threads(1)
    gas = case["gas"]
    micro = SAMPLES // gas
    engine = muon_cases.build_engine(rank, {**case, "micro_batch": micro}, make_probe)
    for step in range(case["steps"]):
        tokens, x, t = samples(step, rank)
        for m in range(gas):
            part = slice(m * micro, (m + 1) * micro)
            engine.backward(engine(tokens[part], x[part], t[part]))
            engine.step()
    return muon_cases.report(engine, case["stage"])


def reference(world: int, steps: int) -> dict[str, Any]:
    """torch.optim.Muon + AdamW on the mean gradient over every rank's samples (exact: see above)."""
    model = make_probe()
    named = list(model.named_parameters())
    matrices = [p for n, p in named if uses_muon(n, p.shape)]
    rest = [p for n, p in named if not uses_muon(n, p.shape)]
    cfg = muon_cases.MUON
    muon = torch.optim.Muon(matrices, lr=cfg["muon_lr"], momentum=cfg["momentum"], weight_decay=cfg["weight_decay"])
    adamw = torch.optim.AdamW(
        rest, lr=cfg["adam_lr"], betas=muon_cases.BETAS, eps=muon_cases.EPS, weight_decay=cfg["weight_decay"], fused=True
    )
    for step in range(steps):
        batches = [samples(step, rank) for rank in range(world)]
        model.zero_grad(set_to_none=True)
        model(*(torch.cat(parts) for parts in zip(*batches))).backward()
        muon.step()
        adamw.step()
    return {"params": [p.detach().clone() for _, p in named], "matrices": len(matrices)}
