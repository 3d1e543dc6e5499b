"""Per-rank scenarios for test_data_efficiency.py (module level so the harness can pickle them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import shardwise
from shardwise.data import RepeatingLoader
from shardwise.data_efficiency import CurriculumSampler, SeqlenTruncation, convert_to_random_ltd
from shardwise.data_efficiency.random_ltd import random_ltd_layers
from shardwise.testing.models import Block, GPTConfig, TinyGPT, TokenDataset

TINY = GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=32)
SAMPLES = 48


def dataset() -> TokenDataset:
    return TokenDataset(SAMPLES, TINY.block_size, TINY.vocab_size, seed=3)


def difficulty_of(data: TokenDataset) -> list[int]:
    """The data-sampling metric: the first token of each sample (0..63)."""
    return [int(row[0]) for row in data.data]


class SeenSeqlen(nn.Module):
    """Records the ``curriculum_seqlen`` each forward receives and the length the model gets."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.inner = SeqlenTruncation(model)
        self.seen: list[tuple[int | None, int]] = []

    def forward(self, x: torch.Tensor, y: torch.Tensor, curriculum_seqlen: int | None = None) -> torch.Tensor:
        self.seen.append((curriculum_seqlen, min(x.shape[1], curriculum_seqlen or x.shape[1])))
        return self.inner(x, y, curriculum_seqlen=curriculum_seqlen)


def config(stage: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 1000,
        "curriculum_learning": {
            "enabled": True,
            "curriculum_type": "seqlen",
            "min_difficulty": 4,
            "max_difficulty": 16,
            "schedule_type": "fixed_linear",
            "schedule_config": {"total_curriculum_step": 6, "difficulty_step": 4},
        },
    }
    if case.get("custom"):
        cfg["curriculum_learning"].update(schedule_type="custom", schedule_config={})
    efficiency: dict[str, Any] = {"enabled": True, "seed": 5}
    if case.get("ltd"):
        efficiency["data_routing"] = {
            "enabled": True,
            "random_ltd": {
                "enabled": True,
                "total_layer_num": 3,
                "random_ltd_layer_num": 2,
                "random_ltd_layer_id": [0, 2],
                "model_type": "decoder",
                "hidden_state_order": "batch_seq_dim",
                "random_ltd_schedule": {
                    "min_value": 4,
                    "max_value": 16,
                    "schedule_type": "fixed_linear",
                    "schedule_config": {"require_steps": 6, "seq_per_step": 2},
                },
            },
        }
    if case.get("index"):
        efficiency["data_sampling"] = {
            "enabled": True,
            "num_epochs": 4,
            "curriculum_learning": {
                "enabled": True,
                "curriculum_metrics": {
                    "first": {
                        "index_to_sample_path": case["index"]["index_to_sample"],
                        "index_to_metric_path": case["index"]["index_to_metric"],
                        "difficulty_type": "value",
                        "clustering_type": "schedule_based",
                        "min_difficulty": 16,
                        "max_difficulty": 64,
                        "schedule_type": "fixed_linear",
                        "schedule_config": {"total_curriculum_step": 8, "difficulty_step": 8},
                    }
                },
            },
        }
    cfg["data_efficiency"] = efficiency
    return cfg


def build(stage: int, world: int, case: dict[str, Any], seed: int) -> tuple[Any, RepeatingLoader, SeenSeqlen]:
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    model = TinyGPT(TINY)
    if case.get("ltd"):
        convert_to_random_ltd(model, Block, [0, 2])
    seen = SeenSeqlen(model)
    engine, _, loader, _ = shardwise.initialize(
        model=seen, training_data=dataset(), config=config(stage, world, case)
    )
    return engine, RepeatingLoader(loader), seen


def train(engine: Any, batches: RepeatingLoader, steps: int, check: list[Any] | None = None) -> list[float]:
    out = []
    for _ in range(steps):
        total = 0.0
        for _ in range(engine.gradient_accumulation_steps()):
            x, y = next(batches)
            if check is not None:
                check.append(x[:, 0].tolist())
            loss = engine(x.to(engine.device), y.to(engine.device))  # (a no-op on the CPU)
            engine.backward(loss)
            engine.step()
            total += loss.item()
        t = torch.tensor([total], dtype=torch.float64)
        dist.all_reduce(t)
        out.append(t.item())
    return out


def model_receives_the_scheduled_seqlen(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    engine, batches, seen = build(case["stage"], world, {}, seed=0)
    train(engine, batches, 8)
    engine.eval()
    x, y = next(batches)
    engine(x.to(engine.device), y.to(engine.device))
    return {"seen": seen.seen}


def custom_schedule_reaches_the_model(rank: int, world: int) -> list[Any]:
    engine, batches, seen = build(0, world, {"custom": True}, seed=0)
    engine.set_custom_curriculum_learning_schedule(lambda step: 4 if step < 3 else 12)
    train(engine, batches, 4)
    return [s for s, _ in seen.seen]


def resume_mid_curriculum(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """Train 2N steps; versus train N, save, fresh engine (other init), load, train N."""
    n, root = 3, Path(case["dir"])
    engine, batches, _ = build(case["stage"], world, case, seed=0)
    sampler = engine.training_dataloader.sampler
    ltd = random_ltd_layers(engine.module)
    first_checks: list[Any] = []
    first = train(engine, batches, n, first_checks)
    kept_after_first = [layer.kept_tokens for layer in ltd]
    engine.save_checkpoint(root)
    reference = train(engine, batches, n)
    reference_state = {k: v for k, v in engine.step_hooks.state_dict().items()}

    resumed, batches2, seen2 = build(case["stage"], world, case, seed=1)
    resumed.load_checkpoint(root)
    again = train(resumed, batches2, n)
    return {
        "first": first,
        "reference": reference,
        "resumed": again,
        "hook_state_equal": resumed.step_hooks.state_dict() == reference_state,
        "curriculum_sampler": isinstance(sampler, CurriculumSampler),
        "first_tokens": first_checks,
        "kept_after_first": kept_after_first,
        "seqlens_after_resume": [s for s, _ in seen2.seen],
    }
