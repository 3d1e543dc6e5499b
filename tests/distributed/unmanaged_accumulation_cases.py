"""Rank side of test_unmanaged_accumulation: windows of 2, 3, 1 and 2 micro batches, each ended by
the script's ``step()`` (``managed_gradient_accumulation: false``) or, as the reference, by forcing the
boundary on the last micro batch of each window (managed mode)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import shardwise

WINDOWS = (2, 3, 1, 2)
GAS = 2  # the config's: backward divides each loss by it in both modes


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))


def run(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """Train the windows; the losses, the final parameters (whole), the counters, and in unmanaged
    mode what ``is_gradient_accumulation_boundary()`` said between backwards and whether forcing the
    boundary was refused."""
    model = _model()
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.05}},
        "zero_optimization": {"stage": case["stage"], "stage3_param_persistence_threshold": 0},
        "managed_gradient_accumulation": not case["unmanaged"],
    }
    engine, *_ = shardwise.initialize(model=model, config=config)
    generator = torch.Generator().manual_seed(100 + rank)
    losses, boundaries = [], []
    for size in WINDOWS:
        for i in range(size):
            x = torch.randn(4, 8, generator=generator)
            loss = engine(x).pow(2).mean()
            if not case["unmanaged"]:
                engine.set_gradient_accumulation_boundary(i == size - 1)
            engine.backward(loss)
            boundaries.append(engine.is_gradient_accumulation_boundary())
            losses.append(loss.item())
            if not case["unmanaged"]:
                engine.step()
        if case["unmanaged"]:
            engine.step()
    refused = None
    if case["unmanaged"]:
        try:
            engine.set_gradient_accumulation_boundary(True)
        except AssertionError as error:
            refused = str(error)
    with shardwise.zero.GatheredParameters(list(model.parameters())):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    counters = (engine.global_steps, engine.global_samples, engine.managed_gradient_accumulation())
    engine.destroy()
    return {"loss": losses, "params": params, "counters": counters, "boundaries": boundaries, "refused": refused}
