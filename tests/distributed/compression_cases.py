"""Rank functions for test_compression_training.py (spawned by run_distributed)."""

from __future__ import annotations

import torch
from torch import nn

import shardwise
from shardwise.compression.compress import compression_scheduler
from shardwise.config.errors import ConfigError


class TinyBert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.query, self.key, self.value, self.output = (nn.Linear(16, 16) for _ in range(4))
        self.head = nn.Linear(16, 32)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        b, t, _ = h.shape
        heads = self.query.out_features // 4
        q, k, v = (p(h).view(b, t, heads, 4).transpose(1, 2) for p in (self.query, self.key, self.value))
        a = torch.softmax(q @ k.transpose(-1, -2) / 2.0, -1) @ v
        h = h + self.output(a.transpose(1, 2).reshape(b, t, -1))
        return nn.functional.cross_entropy(self.head(h).reshape(-1, 32), y.reshape(-1))


def config(stage: int, bf16: bool = False) -> dict:
    return {
        "bf16": {"enabled": bf16},
        "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage},
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {
                    "enabled": True,
                    "schedule_offset": 2,
                    "quantize_weight_in_forward": True,
                },
                "different_groups": {
                    "wq": {
                        "params": {"start_bits": 8, "target_bits": 6, "quantization_period": 2},
                        "modules": ["query", "key", "value", "output"],
                    }
                },
            },
            "head_pruning": {
                "shared_parameters": {"enabled": True, "schedule_offset": 4, "num_heads": 4},
                "different_groups": {
                    "hp": {
                        "params": {"dense_ratio": 0.5},
                        "modules": ["output"],
                        "related_modules": [["query", "key", "value"]],
                    }
                },
            },
        },
    }


def run(rank: int, world: int, tmp: str, stage: int, bf16: bool = False) -> dict:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randint(0, 32, (8, 6), generator=gen)
    y = (x + 1) % 32
    model = TinyBert()
    engine, *_ = shardwise.initialize(
        model=model, model_parameters=model.parameters(), config=config(stage, bf16)
    )
    x, y = x.to(engine.device), y.to(engine.device)  # (the GPU tests run these cases too)
    losses = []
    for _ in range(12):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    scheduler = compression_scheduler(model)
    bits = model.output.compression["weight_quantization"].bits
    heads_on = model.output.compression["head_pruning"].active
    engine.save_checkpoint(tmp, tag="t")
    fresh = TinyBert()
    engine2, *_ = shardwise.initialize(
        model=fresh, model_parameters=fresh.parameters(), config=config(stage, bf16)
    )
    engine2.load_checkpoint(tmp, tag="t")
    resumed = compression_scheduler(fresh)
    error = ""
    try:
        other = TinyBert()
        shardwise.initialize(model=other, model_parameters=other.parameters(), config=config(3))
    except ConfigError as err:
        error = str(err)
    return {
        "losses": losses,
        "steps": scheduler.training_steps,
        "resumed_steps": resumed.training_steps,
        "bits": bits,
        "heads_on": heads_on,
        "resumed_bits": fresh.output.compression["weight_quantization"].bits,
        "resumed_heads": fresh.output.compression["head_pruning"].active,
        "stage3_error": error,
    }


def quant_config() -> dict:
    cfg = config(3)
    section = cfg["compression_training"]
    del section["head_pruning"]
    section["activation_quantization"] = {
        "shared_parameters": {"enabled": True, "schedule_offset": 0, "range_calibration": "dynamic"},
        "different_groups": {"aq": {"params": {"bits": 8}, "modules": ["output"]}},
    }
    return cfg


def run_stage3(rank: int, world: int, tmp: str, under_init: bool) -> dict:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randint(0, 32, (8, 6), generator=gen)
    y = (x + 1) % 32
    if under_init:
        with shardwise.zero.Init(config_dict_or_path=quant_config()):
            model = TinyBert()
    else:
        model = TinyBert()
    engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=quant_config())
    x, y = x.to(engine.device), y.to(engine.device)  # (the GPU tests run these cases too)
    losses = []
    for _ in range(12):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.save_checkpoint(tmp, tag="t")
    fresh = TinyBert()
    engine2, *_ = shardwise.initialize(
        model=fresh, model_parameters=fresh.parameters(), config=quant_config()
    )
    engine2.load_checkpoint(tmp, tag="t")
    return {
        "losses": losses,
        "bits": model.output.compression["weight_quantization"].bits,
        "resumed_steps": compression_scheduler(fresh).training_steps,
        "resumed_bits": fresh.output.compression["weight_quantization"].bits,
    }


def run_case(rank: int, world: int, case: dict) -> dict:
    """One case of the test module's grid (``run_distributed_cases``): ``run`` or ``run_stage3`` in its own
    checkpoint directory."""
    if case["kind"] == "stage3":
        return run_stage3(rank, world, case["tmp"], case["under_init"])
    return run(rank, world, case["tmp"], case["stage"], case["bf16"])
