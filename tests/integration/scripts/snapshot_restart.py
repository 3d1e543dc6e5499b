"""A script that only calls ``load_checkpoint`` at start: the engine snapshots by itself.

Usage (under the launcher): ``snapshot_restart.py DIR STEPS KILL_AT``. ZeRO-2 on two ranks, the
engine's loader over 64 samples, ``checkpoint.snapshot_interval`` 2 into ``DIR/snaps``. On the
first attempt rank 1 SIGKILLs itself after step ``KILL_AT`` (once the snapshot being written is
published, so the resume point is known: the newest snapshot). After the run, every rank trains
an uninterrupted reference from scratch in the same processes (no snapshots, no kill). Rank 0
writes ``DIR/final.pt`` and ``DIR/reference.pt`` (flat weights).
"""

import os
import signal
import sys
from pathlib import Path

import torch

import shardwise

args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
root, steps, kill_at = Path(args[0]), int(args[1]), int(args[2])
restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
g = torch.Generator().manual_seed(5)
data = [(torch.randn(16, generator=g), torch.randn(4, generator=g)) for _ in range(64)]


def build(checkpoint):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 2}, "checkpoint": checkpoint}  # fmt: skip
    engine, _, loader, _ = shardwise.initialize(
        model=model, model_parameters=model.parameters(), config=config, training_data=data
    )
    return engine, loader


def train(engine, loader, die_at=None):
    batches = iter(loader)  # after load_checkpoint: a pass started before a load is superseded by it
    while engine.global_steps < steps:
        x, y = next(batches)
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
        if engine.global_steps == die_at:
            engine.wait_for_checkpoint()
            os.kill(os.getpid(), signal.SIGKILL)
    engine.wait_for_checkpoint()
    engine.optimizer.wait_for_parameters()
    return torch.cat([p.detach().flatten() for p in engine.module.parameters()])


engine, loader = build({"snapshot_interval": 2, "snapshot_dir": str(root / "snaps")})
engine.load_checkpoint(root / "ckpt")  # nothing saved there: the newest snapshot, if any
rank = engine.global_rank
print(f"restart {restart} rank {rank} resumed at step {engine.global_steps}", flush=True)
final = train(engine, loader, kill_at if restart == 0 and rank == 1 else None)
reference = train(*build({}))
if rank == 0:
    torch.save(final, root / "final.pt")
    torch.save(reference, root / "reference.pt")
