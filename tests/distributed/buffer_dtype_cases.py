"""Rank side of test_buffer_dtypes: a bf16 run's buffers under ``data_types`` at every ZeRO stage."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import shardwise

INV_FREQ = 1.0 / (10000 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))  # not exact in bf16


class _Router(nn.Module):
    """Names its ``bias`` buffer for fp32, as transformers' MoE routers do."""

    _keep_in_fp32_modules_strict = ["bias"]

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("bias", torch.tensor([5.001, 5.002, 5.003, 5.004]))


class RotaryNet(nn.Module):
    """A linear layer whose input is scaled by a rotary-style ``inv_freq`` buffer (read in fp32 and
    cast to the activations' dtype, as transformers' rotary embeddings do), and a router buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv_freq", INV_FREQ.clone())
        self.router = _Router()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = (self.inv_freq.float() + self.router.bias.float()).to(x.dtype)
        return self.fc(x * scale).float().pow(2).mean()


def run(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """One bf16 step at ``case["stage"]`` with ``case["data_types"]``: the buffers' dtypes before and
    after the step, and whether ``inv_freq`` still holds its fp32 values bit for bit."""
    torch.manual_seed(0)
    model = RotaryNet()
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": case["stage"]},
        "data_types": case["data_types"],
    }
    engine, *_ = shardwise.initialize(model=model, config=config)
    dtypes = lambda: {name: str(buf.dtype).removeprefix("torch.") for name, buf in model.named_buffers()}  # noqa: E731
    before = dtypes()
    loss = engine(torch.randn(2, 4, dtype=torch.bfloat16))
    engine.backward(loss)
    engine.step()
    exact = bool(torch.equal(model.inv_freq, INV_FREQ)) if model.inv_freq.dtype == torch.float32 else None
    engine.destroy()
    return {"before": before, "after": dtypes(), "inv_freq_exact": exact, "loss": float(loss)}
