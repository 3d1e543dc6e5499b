"""1-bit optimizers benchmark: OneBitAdam and ZeroOneAdam against AdamW, OneBitLamb against Lamb,
at ZeRO stage 0, the 17M GPT, 2 gloo ranks.

One command runs the five optimizers side by side in one spawn (same model, seed, data, micro
batch) and prints, for the steps after the warm-up, the bytes one rank puts on the wire per step
(from the comms logger) and the step time (of the slower rank), both averaged over the timed steps
(0/1 Adam alternates silent local steps and 1-bit syncs), with their ratios::

    python benchmarks/onebit_adam_bench.py                 # 17M GPT, ~3-5 minutes on 2 cores
    python benchmarks/onebit_adam_bench.py --quick         # a small GPT, well under a minute
    python benchmarks/onebit_adam_bench.py --out results.json

OneBitAdam and OneBitLamb run with ``freeze_step`` = ``--warmup``, ZeroOneAdam with
``var_freeze_step`` = ``--warmup`` and local steps that grow quickly (``local_step_scaler`` 1,
``local_step_clipper`` 4: after the freeze it syncs at intervals 1, 2, 4, 4, ...); every optimizer
trains ``--warmup`` steps first (not timed), then ``--steps`` timed steps. Step time is forward + backward + step of one optimizer
step (gradient accumulation 1), fp32. This is a benchmark, not a test: nothing here asserts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))


def _config(optimizer: dict[str, Any], micro: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "optimizer": optimizer,
        "zero_optimization": {"stage": 0},
        "comms_logger": {"enabled": True},
        "steps_per_print": 100000,
    }


def _run(rank: int, world: int, name: str, optimizer: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import shardwise
    from shardwise.comm.comms_logger import COMMS_LOGGER
    from shardwise.testing import models

    torch.manual_seed(0)
    cfg = (
        models.gpt_17m()
        if not args["quick"]
        else models.GPTConfig(vocab_size=512, block_size=64, n_layer=2, n_head=4, n_embd=128)
    )
    model = models.TinyGPT(cfg)
    engine, _, _, _ = shardwise.initialize(model=model, config=_config(optimizer, args["micro"]))
    gen = torch.Generator().manual_seed(100 + rank)
    batches = [
        torch.randint(0, cfg.vocab_size, (args["micro"], cfg.block_size + 1), generator=gen) for _ in range(4)
    ]

    def one_step(i: int) -> None:
        row = batches[i % len(batches)]
        loss = engine(row[:, :-1], row[:, 1:])
        engine.backward(loss)
        engine.step()

    for i in range(args["warmup"]):
        one_step(i)
    times, step_bytes, ops = [], [], set()
    for i in range(args["steps"]):
        COMMS_LOGGER.reset()
        dist.barrier()
        t0 = time.perf_counter()
        one_step(i)
        elapsed = torch.tensor([time.perf_counter() - t0])
        total = sum(
            size * row["count"] for sizes in COMMS_LOGGER.summary().values() for size, row in sizes.items()
        )
        ops.update(COMMS_LOGGER.summary())
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(float(elapsed))
        step_bytes.append(total)
    params = sum(p.numel() for p in model.parameters())
    engine.destroy()
    return {
        "name": name,
        "params": params,
        "ms": 1e3 * statistics.mean(times),
        "bytes": statistics.mean(step_bytes),
        "ops": sorted(ops),
    }


def _rank_main(rank: int, world: int, args: dict[str, Any]) -> list[dict[str, Any]]:
    import torch

    torch.set_num_threads(1)
    hyper = {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}
    warm = args["warmup"]
    zero_one = {"var_freeze_step": warm, "local_step_scaler": 1, "local_step_clipper": 4}
    optimizers = [
        ("AdamW", {"type": "AdamW", "params": hyper}),
        ("OneBitAdam", {"type": "OneBitAdam", "params": {**hyper, "freeze_step": warm}}),
        ("ZeroOneAdam", {"type": "ZeroOneAdam", "params": {**hyper, **zero_one}}),
        ("Lamb", {"type": "Lamb", "params": hyper}),
        ("OneBitLamb", {"type": "OneBitLamb", "params": {**hyper, "freeze_step": warm}}),
    ]
    return [_run(rank, world, name, optimizer, args) for name, optimizer in optimizers]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--warmup", type=int, default=3, help="untimed steps first (OneBitAdam's freeze_step)"
    )
    parser.add_argument("--steps", type=int, default=8, help="timed steps after the warm-up")
    parser.add_argument("--micro", type=int, default=4, help="micro batch per rank")
    parser.add_argument("--quick", action="store_true", help="a small GPT instead of the 17M one")
    parser.add_argument("--out", type=Path, help="write the numbers to this JSON file")
    args = parser.parse_args(argv)

    from shardwise.testing import run_distributed

    spec = {"warmup": args.warmup, "steps": args.steps, "micro": args.micro, "quick": args.quick}
    rows = run_distributed(_rank_main, 2, args=(spec,), timeout=1800)[0]
    by_name = {row["name"]: row for row in rows}
    print(
        f"1-bit optimizers, ZeRO stage 0, fp32, 2 gloo ranks x 1 thread, {rows[0]['params'] / 1e6:.1f}M params"
    )
    print(
        f"after {args.warmup} warm-up steps; {args.steps} timed steps; per optimizer step (mean), one rank:"
    )
    print(f"{'optimizer':12} {'bytes sent':>14} {'step ms':>10}  collectives")
    for row in rows:
        print(f"{row['name']:12} {row['bytes']:>14,.0f} {row['ms']:>10.1f}  {', '.join(row['ops'])}")
    for base, onebit in (("AdamW", "OneBitAdam"), ("AdamW", "ZeroOneAdam"), ("Lamb", "OneBitLamb")):
        a, b = by_name[base], by_name[onebit]
        print(
            f"ratio {base} / {onebit}: bytes {a['bytes'] / max(b['bytes'], 1):.1f}x fewer, "
            f"step time {a['ms'] / b['ms']:.2f}x"
        )
    if args.out:
        args.out.write_text(json.dumps({"rows": rows, "args": spec}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
