"""Per-rank scenarios for test_progressive_layer_drop.py (module level so the harness can pickle them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import shardwise
from shardwise.data import RepeatingLoader
from shardwise.runtime.progressive_layer_drop import keep_layer
from shardwise.testing.models import GPTConfig, TinyGPT, TokenDataset

TINY = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=32)
THETA, GAMMA = 0.5, 0.5


class DroppingGPT(nn.Module):
    """TinyGPT whose blocks are skipped with PLD's per-layer keep probability during training.

    The draws come from a generator seeded identically on every rank, so every rank skips the
    same blocks (required at ZeRO-3, where a block's forward gathers its parameters collectively).
    """

    def __init__(self) -> None:
        super().__init__()
        self.gpt = TinyGPT(TINY)
        self.draws = torch.Generator().manual_seed(7)
        self.thetas: list[float | None] = []
        self.blocks_run = 0

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor,
        progressive_layer_drop: bool = False,
        pld_theta: float = 1.0,
    ) -> torch.Tensor:
        self.thetas.append(pld_theta if progressive_layer_drop else None)
        gpt = self.gpt
        x = gpt.wte(idx) + gpt.wpe(torch.arange(idx.shape[1]))
        for i, block in enumerate(gpt.blocks):
            if progressive_layer_drop and not keep_layer(pld_theta, i, len(gpt.blocks), self.draws):
                continue
            self.blocks_run += 1
            x = block(x)
        logits = gpt.lm_head(gpt.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def build(stage: int, pld: bool, seed: int, samples: int = 64) -> tuple[Any, RepeatingLoader, DroppingGPT]:
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    model = DroppingGPT()
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 1000,
    }
    if pld:
        config["progressive_layer_drop"] = {"enabled": True, "theta": THETA, "gamma": GAMMA}
    data = TokenDataset(samples, TINY.block_size, TINY.vocab_size, seed=3)
    engine, _, loader, _ = shardwise.initialize(model=model, training_data=data, config=config)
    return engine, RepeatingLoader(loader), model


def train(engine: Any, batches: RepeatingLoader, steps: int) -> list[float]:
    losses = []
    for _ in range(steps * engine.gradient_accumulation_steps()):
        x, y = next(batches)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def thetas_through_a_resume(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """3 steps, save, 3 more; a fresh engine loads the save and runs the same 3 steps."""
    root = Path(case["dir"])
    engine, batches, model = build(case["stage"], True, seed=0)
    train(engine, batches, 3)
    engine.save_checkpoint(root)
    theta_at_save = engine.get_pld_theta()
    draws = model.draws.get_state()
    train(engine, batches, 3)
    engine.eval()
    x, y = next(batches)
    engine(x, y)
    resumed, batches2, model2 = build(case["stage"], True, seed=1)
    resumed.load_checkpoint(root)
    model2.draws.set_state(draws)
    theta_after_load = resumed.get_pld_theta()
    train(resumed, batches2, 3)
    return {
        "thetas": model.thetas,
        "resumed_thetas": model2.thetas,
        "theta_at_save": theta_at_save,
        "theta_after_load": theta_after_load,
    }


def effect_on_blocks_and_loss(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """Blocks run and loss over the same steps with and without PLD (8 samples: learnable by heart)."""
    out = {}
    for pld in (False, True):
        engine, batches, model = build(case["stage"], pld, seed=0, samples=8)
        losses = train(engine, batches, 12)
        out["pld" if pld else "plain"] = {
            "blocks": model.blocks_run,
            "first": losses[:4],
            "last": losses[-4:],
        }
        out["theta_api" if pld else "theta_api_off"] = engine.get_pld_theta()
    return out
