"""Elastic scale-down from the engine's snapshots: 3 nodes lose one and the other two carry on.

Usage (under the launcher): ``snapshot_elastic.py DIR STEPS MODE``. The ``elasticity`` block keeps
the global batch at 12 (micro batch 2: gas 2 at three ranks, 3 at two); the engine's loader reads
indexed samples. MODE ``snap``: snapshots every 2 steps into ``DIR/snaps``; on the first attempt
(no ``DIR/attempted``) rank 2 kills its node's agent after step 3, once the step-2 snapshot is
published. MODE ``save``: no snapshots; ``save_checkpoint(DIR/ckpt)`` at the end (the reference
that changes size by hand). Both call ``load_checkpoint(DIR/ckpt)`` at start. Rank 0 writes the
final flat weights to ``DIR/final.pt``.
"""

import os
import signal
import sys
from pathlib import Path

import torch

import shardwise

args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
root, steps, mode = Path(args[0]), int(args[1]), args[2]
g = torch.Generator().manual_seed(5)
data = [(torch.randn(16, generator=g), torch.randn(4, generator=g)) for _ in range(120)]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
config = {
    "elasticity": {"enabled": True, "max_train_batch_size": 12, "micro_batch_sizes": [2], "min_gpus": 2,
                   "max_gpus": 3, "version": 0.1},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    "zero_optimization": {"stage": 2},
    "checkpoint": {"snapshot_interval": 2, "snapshot_dir": str(root / "snaps")} if mode == "snap" else {},
}  # fmt: skip
engine, _, loader, _ = shardwise.initialize(
    model=model, model_parameters=model.parameters(), config=config, training_data=data
)
rank, world, gas = engine.global_rank, engine.world_size, engine.gradient_accumulation_steps()
first_attempt = not Path(root, "attempted").exists()
engine.load_checkpoint(root / "ckpt")
print(f"rank {rank} of {world} (gas {gas}) resumed at step {engine.global_steps}", flush=True)
shardwise.comm.barrier()
if first_attempt and rank == 0:
    root.mkdir(parents=True, exist_ok=True)
    Path(root, "attempted").touch()
batches = iter(loader)
while engine.global_steps < steps:
    for _ in range(gas):
        x, y = next(batches)
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
    if mode == "snap" and first_attempt and rank == 2 and engine.global_steps == 3:
        engine.wait_for_checkpoint()
        os.kill(os.getppid(), signal.SIGKILL)
if mode == "save":
    engine.save_checkpoint(root / "ckpt")
engine.wait_for_checkpoint()
if rank == 0:
    engine.optimizer.wait_for_parameters()
    torch.save(torch.cat([p.detach().flatten() for p in engine.module.parameters()]), root / "final.pt")
