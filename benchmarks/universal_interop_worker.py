"""One rank of the universal-checkpoint interop check (run by ``benchmarks/universal_interop.py``).

The same file runs under the project's interpreter (``--side shardwise``: ``import shardwise as
deepspeed``) and under a side venv with DeepSpeed 0.19.8 (``--side deepspeed``), so both sides
execute the very same training code through DeepSpeed's API. Rank variables come from the
environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``).

Actions:

``save``   train ``--steps`` steps from a seeded model, save ``--ckpt`` (tag ``global_step<N>``),
           then continue ``--more`` steps and record their losses (the writer's continued run).
``resume`` build a differently seeded model with ``checkpoint.load_universal``, load the universal
           checkpoint in ``--ckpt``, train ``--more`` steps and record their losses.

Each step's batch is a function of the step number only (a global batch of 4 samples, each rank
taking its slice), so a run at another world size sees the same samples; the recorded loss is the
mean over ranks (= the global batch's mean). Rank 0 writes ``{"losses": [...]}`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch
from torch import nn

GLOBAL_BATCH = 4


class Net(nn.Module):
    """A small MLP with biases and a loss head: ``forward(x, y) -> mse``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Mean squared error of the prediction (computed in fp32)."""
        out = self.head(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))
        return ((out.float() - y) ** 2).mean()


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of step ``step``'s global batch."""
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 8, generator=gen)
    y = torch.randn(GLOBAL_BATCH, 4, generator=gen)
    per = GLOBAL_BATCH // world
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def config(stage: int, dtype: str, world: int, universal: bool) -> dict[str, Any]:
    """The DeepSpeed config both sides use."""
    cfg: dict[str, Any] = {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 1000,
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    return cfg


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--side", choices=["deepspeed", "shardwise"], required=True)
    parser.add_argument("--action", choices=["save", "resume"], required=True)
    parser.add_argument("--stage", type=int, required=True)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--more", type=int, default=2)
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    if args.side == "deepspeed":
        import deepspeed
    else:
        import shardwise as deepspeed  # type: ignore[no-redef]
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    torch.manual_seed(0 if args.action == "save" else 1)
    model = Net()
    cfg = config(args.stage, args.dtype, world, universal=args.action == "resume")
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32

    def step(n: int) -> float:
        x, y = batch(n, rank, world)
        loss = engine(x.to(dtype), y)
        engine.backward(loss)
        engine.step()
        value = loss.detach().float().clone()
        torch.distributed.all_reduce(value)
        return float(value) / world

    start = 0
    if args.action == "save":
        for n in range(args.steps):
            step(n)
        engine.save_checkpoint(args.ckpt, tag=f"global_step{args.steps}")
        start = args.steps
    else:
        path, _ = engine.load_checkpoint(args.ckpt)
        if path is None:
            raise SystemExit(f"load_checkpoint({args.ckpt}) loaded nothing")
        start = int(engine.global_steps)
    losses = [step(start + i) for i in range(args.more)]
    if rank == 0:
        with open(args.out, "w") as handle:
            json.dump({"losses": losses, "global_steps": int(engine.global_steps)}, handle)
    torch.distributed.barrier()
    # DeepSpeed's CPU communication threads can abort the interpreter's teardown ("terminate called
    # without an active exception") after all work is done; leave without it, results are written.
    os._exit(0)


if __name__ == "__main__":
    main()
