"""Elastic scale-down drill: the ``elasticity`` block keeps the global batch at any world size.

Usage (under the launcher): ``elastic_resume.py CKPT_DIR STEPS KILL_AT``. Each step trains on
the same 12 samples whatever the world size: rank ``r``'s micro batch ``m`` takes samples
``(m * world + r) * 2`` and the next (the elasticity block sets the micro batch, 2, and the
accumulation steps for the world size). On the first attempt, at step ``KILL_AT`` (0: never),
rank 2 SIGKILLs its node's agent: the node is lost for good and the others carry on without it.
Rank 0 writes the final flat weights to ``CKPT_DIR/final.pt``.
"""

import os
import signal
import sys
from pathlib import Path

import torch

import shardwise

args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
ckpt, steps, kill_at = args[0], int(args[1]), int(args[2])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
config = {
    "elasticity": {"enabled": True, "max_train_batch_size": 12, "micro_batch_sizes": [2], "min_gpus": 2,
                   "max_gpus": 3, "version": 0.1},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    "zero_optimization": {"stage": 2},
}  # fmt: skip
engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=config)
rank, world, gas = engine.global_rank, engine.world_size, engine.gradient_accumulation_steps()
first_attempt = not Path(ckpt, "attempted").exists()
engine.load_checkpoint(ckpt)
print(f"rank {rank} of {world} (gas {gas}) resumed at step {engine.global_steps}", flush=True)
shardwise.comm.barrier()
if first_attempt and rank == 0:
    Path(ckpt).mkdir(parents=True, exist_ok=True)
    Path(ckpt, "attempted").touch()
for step in range(engine.global_steps, steps):
    g = torch.Generator().manual_seed(step)
    xs, ys = torch.randn(12, 16, generator=g), torch.randn(12, 4, generator=g)
    for micro in range(gas):
        start = (micro * world + rank) * 2
        loss = torch.nn.functional.mse_loss(engine(xs[start : start + 2]), ys[start : start + 2])
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(ckpt)
    if first_attempt and rank == 2 and engine.global_steps == kill_at:
        os.kill(os.getppid(), signal.SIGKILL)
if rank == 0:
    torch.save(torch.cat([p.detach().flatten() for p in engine.module.parameters()]), os.path.join(ckpt, "final.pt"))
