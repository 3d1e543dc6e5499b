"""A training script that survives failures: ZeRO-2, save every step, resume from ``latest``.

Usage (under the launcher): ``kill_and_resume.py CKPT_DIR STEPS KILL_AT MODE``. On the first
attempt only (torch elastic's ``TORCHELASTIC_RESTART_COUNT`` 0 and no ``CKPT_DIR/attempted``
marker from an earlier job-level attempt), at step ``KILL_AT``:

* ``rank``: rank 1 SIGKILLs itself mid-step (after the backward of the step after ``KILL_AT``,
  before its optimizer step), so the last published checkpoint is step ``KILL_AT``;
* ``agent``: rank 1 SIGKILLs its node's agent (its parent: torchrun's agent, or the node daemon
  of the srun/mpirun stand-ins) right after saving;
* ``midsave``: rank 0 SIGKILLs itself inside the save, after the files are written and before
  the checkpoint is published (so ``latest`` still names the step before);
* ``stop``: rank 1 SIGSTOPs itself (a hang: the others' next collective times out);
* ``none``: nothing (the uninterrupted reference).

Rank 0 writes the final flat weights to ``CKPT_DIR/final.pt``; every rank prints where it resumed.
"""

import os
import signal
import sys
from pathlib import Path

import torch

import shardwise
from shardwise.checkpoint import layout

args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
ckpt, steps, kill_at, mode = args[0], int(args[1]), int(args[2]), args[3]
restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
config = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    "zero_optimization": {"stage": 2},
}
engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=config)
rank = engine.global_rank
first_attempt = restart == 0 and not Path(ckpt, "attempted").exists()
engine.load_checkpoint(ckpt)
print(f"restart {restart} rank {rank} resumed at step {engine.global_steps}", flush=True)
if first_attempt and rank == 0:
    Path(ckpt).mkdir(parents=True, exist_ok=True)
    Path(ckpt, "attempted").touch()
if first_attempt and mode == "midsave" and rank == 0:
    real_publish = layout.publish

    def publish_then_die(root, tag):  # the files are written and sealed; die before the rename
        if engine.global_steps == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return real_publish(root, tag)

    layout.publish = publish_then_die
for step in range(engine.global_steps, steps):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(4, 16, generator=g), torch.randn(4, 4, generator=g)
    loss = torch.nn.functional.mse_loss(engine(x), y)
    engine.backward(loss)
    if first_attempt and rank == 1 and mode == "rank" and engine.global_steps == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)  # mid-step: gradients reduced, the optimizer step not taken
    engine.step()
    engine.save_checkpoint(ckpt)
    if first_attempt and rank == 1 and engine.global_steps == kill_at:
        if mode == "agent":
            os.kill(os.getppid(), signal.SIGKILL)
        elif mode == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
if rank == 0:
    torch.save(torch.cat([p.detach().flatten() for p in engine.module.parameters()]), os.path.join(ckpt, "final.pt"))
