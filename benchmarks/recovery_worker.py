"""One rank of ``benchmarks/recovery.py``: the benchmark GPT at ZeRO-2, saved every step or snapshotted.

Args: ``CKPT_DIR STEPS KILL_AT MODE``. MODE ``0``: ``save_checkpoint`` after every step;
``1``: the same with ``checkpoint.async_save``; ``sN``: no saves by the script, the engine's
periodic snapshots every N steps (``checkpoint.snapshot_interval``). Prints one JSON line per
event with wall-clock times: ``step`` (its end and the step's own time), ``save`` (how long the
save blocked the training loop: ``save_checkpoint``, or the snapshot's ``Checkpointer.save``
inside ``engine.step()``), ``killed`` (rank 1, just before SIGKILL on the first attempt at step
KILL_AT), ``resumed``.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

import shardwise
from shardwise.testing.models import TinyGPT, gpt_17m

args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
ckpt, steps, kill_at, mode = args[0], int(args[1]), int(args[2]), args[3]
interval = int(mode[1:]) if mode.startswith("s") else 0
restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
torch.manual_seed(0)
cfg = gpt_17m()
model = TinyGPT(cfg)
config = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
    "zero_optimization": {"stage": 2},
    "checkpoint": {"async_save": mode == "1"},
}
if interval:
    config["checkpoint"] = {"snapshot_interval": interval, "snapshot_dir": str(Path(ckpt, "snaps"))}
engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=config)
rank = engine.global_rank
engine.load_checkpoint(ckpt)


def emit(event: str, **fields: float) -> None:
    print(json.dumps({"event": event, "rank": rank, "restart": restart, "t": time.time(), **fields}), flush=True)


emit("resumed", step=engine.global_steps)
if interval:  # time the snapshot's blocking part: the checkpointer's save called inside engine.step()
    real_save = engine.checkpointer.save

    def timed_save(*a, **k):
        start = time.perf_counter()
        out = real_save(*a, **k)
        emit("save", step=engine.global_steps, seconds=time.perf_counter() - start)
        return out

    engine.checkpointer.save = timed_save
for step in range(engine.global_steps, steps):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, cfg.vocab_size, (4, cfg.block_size), generator=g)
    start = time.perf_counter()
    loss = engine(x, x)
    engine.backward(loss)
    engine.step()
    emit("step", step=engine.global_steps, seconds=time.perf_counter() - start)
    if not interval:
        start = time.perf_counter()
        engine.save_checkpoint(ckpt)
        emit("save", step=engine.global_steps, seconds=time.perf_counter() - start)
    if restart == 0 and rank == 1 and engine.global_steps == kill_at and not Path(ckpt, "killed").exists():
        Path(ckpt, "killed").touch()
        emit("killed", step=engine.global_steps)
        os.kill(os.getpid(), signal.SIGKILL)
engine.wait_for_checkpoint()
