"""Stage 3's bf16 forward against stage 2's on the same weights (a scenario of test_stage3.py).

The model takes a bf16 input and an fp32 target and computes its loss in fp32 inside
``forward``, as many training scripts do. Stages 0-2 (and DeepSpeed at any stage) cast no
forward inputs without ``fp16.auto_cast``; stage 3 must not either, or the target is rounded
to bf16 and the loss differs (~1e-4 relative here, ~1e-3 on the interop MLP).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from zero_reference import config

import shardwise


class _FloatTargetNet(nn.Module):
    """An MLP whose ``forward(x, y)`` returns the fp32 mean squared error against ``y``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.block = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = self.head(self.block(torch.tanh(self.fc1(x))))
        return ((out.float() - y) ** 2).mean()


def float_target(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """Losses of two bf16 steps at stage 2, stage 3 sharded and stage 3 unsharded (the
    persistence threshold above the model), each from the same seed and the same batches."""
    torch.set_num_threads(1)
    variants = {
        "stage2": (2, {}),
        "stage3": (3, {"stage3_param_persistence_threshold": 0}),
        "stage3_persistent": (3, {"stage3_param_persistence_threshold": 100_000}),
    }
    out: dict[str, Any] = {}
    for name, (stage, zero) in variants.items():
        torch.manual_seed(0)
        net = _FloatTargetNet()
        engine, optimizer, _, _ = shardwise.initialize(
            model=net, model_parameters=net.parameters(), config=config(stage, "bf16", 1, 4, world, **zero)
        )
        gen = torch.Generator().manual_seed(100 + rank)
        losses = []
        for _ in range(case["steps"]):
            x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)
            loss = engine(x.to(torch.bfloat16), y)
            losses.append(loss.item())
            engine.backward(loss)
            engine.step()
        out[name] = losses
        if stage == 3:
            out[f"{name}_sharded"] = len(optimizer.record.sharded)
        close = getattr(optimizer, "close", None)
        if close is not None:
            close()
    return out
