"""One rank of the compile benchmark (``compile_bench.py``): the same GPT trained by two engines in
one process, eager and ``engine.compile(backend=...)``, step for step on the same data, alternating
which goes first, so a shared machine's load falls on both alike.

Run by the driver with ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` set; prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

import shardwise
from shardwise.testing.models import GPTConfig, TinyGPT


def _engine(spec: dict[str, Any]) -> Any:
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(**spec["model"], qkv_bias=False))
    config = {
        "train_micro_batch_size_per_gpu": spec["batch"][0],
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        # stage 3: every parameter sharded (the default threshold keeps a small model's whole)
        "zero_optimization": {"stage": spec["stage"], "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = shardwise.initialize(model=model, config=config)
    return engine


def _step(engine: Any, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    return time.perf_counter() - wall, time.process_time() - cpu, loss.item()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True, help="JSON: model, batch, stage, steps, warmup, backend "
                        "(null: the eager engine alone, for comparing eager runs in different environments)")
    args = parser.parse_args()
    spec = json.loads(args.spec)
    torch.set_num_threads(1)
    rank = int(__import__("os").environ["RANK"])
    eager_only = spec["backend"] is None
    names = ("eager",) if eager_only else ("eager", "compiled")
    eager = _engine(spec)
    compiled = None if eager_only else _engine(spec)
    if compiled is not None:
        compiled.compile(backend=spec["backend"])
    runs: dict[str, dict[str, list[float]]] = {k: {"wall": [], "cpu": [], "loss": []} for k in names}
    micro, seq = spec["batch"]
    vocab = spec["model"]["vocab_size"]
    for step in range(spec["steps"]):
        gen = torch.Generator().manual_seed(1000 * step + rank)
        data = torch.randint(0, vocab, (micro, seq + 1), generator=gen)
        x, y = data[:, :-1], data[:, 1:]
        order = names if step % 2 == 0 else names[::-1]
        for name in order:
            wall, cpu, loss = _step(eager if name == "eager" else compiled, x, y)
            for key, value in (("wall", wall), ("cpu", cpu), ("loss", loss)):
                runs[name][key].append(value)
    warm = spec["warmup"]
    out: dict[str, Any] = {"rank": rank}
    for name, run in runs.items():
        out[f"{name}_wall_ms"] = 1e3 * statistics.median(run["wall"][warm:])
        out[f"{name}_cpu_ms"] = 1e3 * statistics.median(run["cpu"][warm:])
        out[f"{name}_losses"] = run["loss"]
    if compiled is not None:
        out["compile_s"] = runs["compiled"]["wall"][0]
        out["targets"] = compiled.compiler.plan.targets
        out["loss_diffs"] = [abs(a - b) for a, b in zip(runs["eager"]["loss"], runs["compiled"]["loss"])]
        out["max_loss_diff"] = max(out["loss_diffs"])
    print(json.dumps(out))


if __name__ == "__main__":
    main()
