"""A training script that survives its own rank's death: ZeRO-2, save every step, resume from ``latest``.

Usage (under the launcher): ``kill_and_resume.py CKPT_DIR STEPS KILL_AT``. On the first attempt
(``TORCHELASTIC_RESTART_COUNT`` 0) rank 1 SIGKILLs itself right after saving step ``KILL_AT``
(0: never); torch elastic restarts both ranks, which resume from the last checkpoint. Rank 0
writes the final flat weights to ``CKPT_DIR/final.pt`` and prints where each attempt resumed.
"""

import os
import signal
import sys

import torch

import shardwise

args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
ckpt, steps, kill_at = args[0], int(args[1]), int(args[2])
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
config = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    "zero_optimization": {"stage": 2},
}
engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=config)
engine.load_checkpoint(ckpt)
rank = engine.global_rank
print(f"attempt {attempt} rank {rank} resumed at step {engine.global_steps}", flush=True)
for step in range(engine.global_steps, steps):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(4, 16, generator=g), torch.randn(4, 4, generator=g)
    loss = torch.nn.functional.mse_loss(engine(x), y)
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(ckpt)
    if attempt == 0 and rank == 1 and engine.global_steps == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
if rank == 0:
    torch.save(torch.cat([p.detach().flatten() for p in engine.module.parameters()]), os.path.join(ckpt, "final.pt"))
