"""One rank of the universal-checkpoint interop check (run by ``benchmarks/universal_interop.py``).

The same file runs under the project's interpreter (``--side shardwise``: ``import shardwise as
deepspeed``) and under a side venv with DeepSpeed 0.19.8 (``--side deepspeed``), so both sides
execute the very same training code through DeepSpeed's API. Rank variables come from the
environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``).

One launch runs several cells (``--cells STAGE:DTYPE:OPTIMIZER ...``) one after the other, each with
a fresh model and engine, so a matrix costs one interpreter start per side and world size, not one
per cell. Cell ``c`` lives in ``--root/<c>/`` (``native/``: the writer's checkpoint, ``universal/``:
the converted one).

Actions:

``save``   per cell: train ``--steps`` steps from a seeded model, save ``native/`` (tag
           ``global_step<N>``), convert it on rank 0 (DeepSpeed: its own ``ds_to_universal``,
           called in-process with one worker; shardwise: ``shardwise_to_universal``), then continue
           ``--more`` steps and record their losses (the writer's continued run). A conversion that
           fails is recorded (``convert_error``), not fatal: the driver converts that cell with
           shardwise's converter instead.
``resume`` per cell: build a differently seeded model with ``checkpoint.load_universal``, load
           ``universal/``, train ``--more`` steps and record their losses.

Each step's batch is a function of the step number only (a global batch of 6 samples, each rank
taking its slice), so a run at another world size sees the same samples; the recorded loss is the
mean over ranks (= the global batch's mean). Each rank appends one JSON line per finished cell to
``--results.rank<r>``; a cell that raises writes its error line and ends the process at once (so
the other ranks' collectives fail fast and the driver relaunches the cells after it).
"""

from __future__ import annotations

import argparse
import json
import os
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

GLOBAL_BATCH = 6  # divisible by 1, 2 and 3 ranks


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


OPTIMIZERS: dict[str, dict[str, Any]] = {
    "AdamW": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
    # DeepSpeed's Muon: the three weight matrices take Muon, the biases AdamW (adam_lr). "standard"
    # is the Newton-Schulz iteration both sides run the same way (DeepSpeed's default "gram" runs
    # in fp16 on DeepSpeed and as "standard" on shardwise).
    "Muon": {
        "type": "Muon",
        "params": {
            "lr": 0.01,
            "muon_lr": 0.02,
            "adam_lr": 0.01,
            "momentum": 0.9,
            "weight_decay": 0.01,
            "ns_method": "standard",
        },
    },
}


def config(stage: int, dtype: str, world: int, universal: bool, optimizer: str = "AdamW") -> dict[str, Any]:
    """The DeepSpeed config both sides use."""
    cfg: dict[str, Any] = {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
        "gradient_accumulation_steps": 1,
        "optimizer": OPTIMIZERS[optimizer],
        "zero_optimization": {"stage": stage},
        "steps_per_print": 1000,
    }
    if optimizer == "Muon" and stage == 3:
        cfg["zero_optimization"]["reduce_scatter"] = False  # DeepSpeed refuses Muon with it at stage 3
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    return cfg


def error_line(error: BaseException) -> str:
    """``Type: message (file:line)``, the line being the innermost DeepSpeed or shardwise frame."""
    frames = traceback.extract_tb(error.__traceback__)
    ours = [f for f in frames if "/deepspeed/" in f.filename or "/shardwise/" in f.filename] or frames
    where = f" ({Path(ours[-1].filename).name}:{ours[-1].lineno})" if ours else ""
    return f"{type(error).__name__}: {error}{where}"[:400]


def convert(side: str, native: Path, universal: Path, tag: str, stage: int) -> str | None:
    """Rank 0: the writer side's own converter; returns its error line, or None.

    shardwise's stage-0 cells are exported as DeepSpeed's native stage-0 layout instead
    (``export_deepspeed_stage0``): DeepSpeed 0.19.8 cannot resume a universal checkpoint at stage 0.
    """
    try:
        if side == "shardwise" and stage == 0:
            from shardwise.checkpoint.deepspeed_export import export_deepspeed_stage0

            export_deepspeed_stage0(native, universal)
        elif side == "deepspeed":
            from deepspeed.checkpoint import ds_to_universal

            ds_to_universal.main(
                SimpleNamespace(
                    input_folder=str(native / tag),
                    output_folder=str(universal / tag),
                    num_extract_workers=1,
                    num_merge_workers=1,
                    keep_temp_folder=False,
                    strict=True,
                    inject_missing_state=True,
                )
            )
        else:
            from shardwise.checkpoint.universal_write import shardwise_to_universal

            shardwise_to_universal(native, universal)
    except BaseException as error:
        return error_line(error)
    return None


def run_cell(deepspeed: Any, args: argparse.Namespace, cell: str, rank: int, world: int) -> dict[str, Any]:
    """Save (and convert) or resume one cell; returns its record."""
    stage_s, dtype, optimizer = cell.split(":")
    stage = int(stage_s)
    folder = Path(args.root) / cell.replace(":", "-")
    native, universal = folder / "native", folder / "universal"
    torch.manual_seed(0 if args.action == "save" else 1)
    model = Net()
    # a native checkpoint (``latest``, shardwise's stage-0 export) loads without load_universal
    native_export = (universal / "latest").is_file() and not (universal / "latest_universal").is_file()
    cfg = config(
        stage, dtype, world, universal=args.action == "resume" and not native_export, optimizer=optimizer
    )
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32

    def step(n: int) -> float:
        x, y = batch(n, rank, world)
        loss = engine(x.to(torch_dtype), y)
        engine.backward(loss)
        engine.step()
        value = loss.detach().float().clone()
        torch.distributed.all_reduce(value)
        return float(value) / world

    record: dict[str, Any] = {"cell": cell}
    if args.action == "save":
        for n in range(args.steps):
            step(n)
        tag = f"global_step{args.steps}"
        engine.save_checkpoint(str(native), tag=tag)
        torch.distributed.barrier()
        if rank == 0:
            record["convert_error"] = convert(args.side, native, universal, tag, stage)
        torch.distributed.barrier()
        start = args.steps
    else:
        path, _ = engine.load_checkpoint(str(universal))
        if path is None:
            raise RuntimeError(f"load_checkpoint({universal}) loaded nothing")
        start = int(engine.global_steps)
    record["losses"] = [step(start + i) for i in range(args.more)]
    record["global_steps"] = int(engine.global_steps)
    torch.distributed.barrier()
    return record


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--side", choices=["deepspeed", "shardwise"], required=True)
    parser.add_argument("--action", choices=["save", "resume"], required=True)
    parser.add_argument("--cells", nargs="+", required=True, help="STAGE:DTYPE:OPTIMIZER ...")
    parser.add_argument("--root", required=True)
    parser.add_argument("--results", required=True, help="each rank appends to <results>.rank<r>")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--more", type=int, default=2)
    args = parser.parse_args()

    if args.side == "deepspeed":
        import deepspeed
    else:
        import shardwise as deepspeed  # type: ignore[no-redef]
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    with open(f"{args.results}.rank{rank}", "a") as results:
        for cell in args.cells:
            try:
                record = run_cell(deepspeed, args, cell, rank, world)
            except BaseException as error:
                results.write(json.dumps({"cell": cell, "error": error_line(error)}) + "\n")
                results.flush()
                os._exit(1)
            results.write(json.dumps(record) + "\n")
            results.flush()
    # DeepSpeed's CPU communication threads can abort the interpreter's teardown ("terminate called
    # without an active exception") after all work is done; leave without it, results are written.
    os._exit(0)


if __name__ == "__main__":
    main()
