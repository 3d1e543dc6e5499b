"""Rank side of test_direct_backward: the same micro batches trained with ``engine.backward(loss)``,
a caller-run ``loss.backward()`` on the engine's outputs, or ``engine.scale(loss).backward()``."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

import shardwise

MICRO_BATCHES = 6


class TwoOutputs(nn.Module):
    """Returns a mapping of two outputs, as transformers' models do, so that both are hooked."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 1)
        self.aux = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden = self.body(x)
        return {"logits": self.head(hidden), "aux": (self.aux(hidden),)}


def run(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """Train MICRO_BATCHES micro batches; the losses, the whole parameters and the counters, or the
    refusal's text when the case expects one."""
    torch.manual_seed(0)
    model = TwoOutputs()
    reference = copy.deepcopy(model)  # plain torch, for the gradient penalty's first value
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": case["gas"],
        "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": case["stage"]},
    }
    if case.get("fp16"):
        config["fp16"] = {"enabled": True, "initial_scale_power": 4, "auto_cast": True}
    if case["stage"] == 3:
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    engine, *_ = shardwise.initialize(model=model, config=config)
    generator = torch.Generator().manual_seed(100 + rank)
    losses, penalties = [], []
    refused = None
    for step in range(MICRO_BATCHES):
        x = torch.randn(4, 8, generator=generator)
        if case["mode"] == "penalty":  # torch.autograd.grad through the outputs is no micro step
            x.requires_grad_(True)
        out = engine(x)
        loss = out["logits"].float().pow(2).mean() + 0.1 * out["aux"][0].float().pow(2).mean()
        if case["mode"] == "penalty":
            (input_grad,) = torch.autograd.grad(out["logits"].sum(), x, create_graph=True)
            penalty = input_grad.pow(2).sum()
            if step == 0:
                (expected,) = torch.autograd.grad(reference(x)["logits"].sum(), x)
                penalties.append((penalty.item(), expected.pow(2).sum().item()))
            loss = loss + 0.01 * penalty
        if case["mode"] in ("engine", "penalty"):
            engine.backward(loss)
        elif case["mode"] == "scale":
            engine.scale(loss).backward()
        else:
            try:
                loss.backward()
            except RuntimeError as error:
                refused = str(error)
                break
        engine.step()
        losses.append(loss.item())
    with shardwise.zero.GatheredParameters(list(model.parameters())):
        params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    counters = (engine.global_steps, engine.global_samples, engine.micro_steps)
    engine.destroy()
    return {"loss": losses, "params": params, "counters": counters, "refused": refused, "penalties": penalties}
