"""Pipeline bubble benchmark: shardwise's schedules against theory and against DeepSpeed's own
pipeline engine, on 2 gloo ranks (2 stages)::

    python benchmarks/pipeline_bubble.py                  # m = 4 and 8 micro batches, about 3 minutes
    python benchmarks/pipeline_bubble.py --quick          # m = 4, fewer steps
    python benchmarks/pipeline_bubble.py --ds-python /work/venv-ds/bin/python   # adds DeepSpeed's column

Workload (``--workload``): ``sleep`` (default), blocks whose forward and backward each take a fixed
wall time (a small linear layer, then ``time.sleep``), so the schedule's bubble shows however loaded
the machine is (a 2-core machine shared with other jobs makes matmul timings noise); or ``mlp``, a
stack of real MLP blocks (``Linear(w, 4w) -> GELU -> Linear(4w, w)`` with a residual). The zero-bubble
schedules gain only with ``mlp``: they split each backward into its input-gradient and
weight-gradient passes, and a sleep is one indivisible backward. Either stack is cut
uniformly into 2 stages (or 4 chunks for the two-chunk schedules), MSE loss, AdamW, ZeRO 0, fp32,
``gradient_accumulation_steps = m``. Per schedule, over ``--rounds`` repeats (the schedules take
turns, order reversed every round): the step time (the least wall time of
``train_batch`` over the timed steps after warm-up, both ranks entering together: on a machine shared
with other work the least time is the one other load disturbed least), and the measured bubble
``1 - m * t_mb / T_step``, where ``t_mb`` is the time this rank's chunks take for one micro batch's
forward and backward with no pipeline around them (measured in the same run, both ranks at once, so
they share the machine as in the step). Theory: ``(p - 1) / (m + p - 1)`` for 1F1B and GPipe,
``(p - 1) / (v m + p - 1)`` for interleaved 1F1B with ``v`` chunks per rank, near 0 for the zero-bubble
schedules (weight gradients fill the gaps). The bubble also holds the optimizer step and the p2p
transfers, which theory leaves out; both are small here.

DeepSpeed's column runs the same layers as a ``deepspeed.pipe.PipelineModule`` with its
``PipelineEngine`` (1F1B, its only training schedule) from the interpreter given by ``--ds-python``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SRC = Path(__file__).resolve().parents[1] / "src"
sys.path.insert(0, str(SRC))

SCHEDULES = [("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2), ("zbv_zero_bubble", 2), ("dualpipev", 2)]


def _layers(args: dict[str, Any], spec: Any, nn: Any) -> list[Any]:
    if args.get("workload") == "sleep":
        block = _sleep_block_class()
        return [spec(block, args["width"], args["fwd_ms"], args["bwd_ms"]) for _ in range(args["blocks"])]

    class Block(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.up, self.act, self.down = nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)

        def forward(self, x: Any) -> Any:
            return x + self.down(self.act(self.up(x)))

    return [spec(Block, args["width"]) for _ in range(args["blocks"])]


def _sleep_block_class() -> Any:
    import torch
    from torch import nn

    class _Sleep(torch.autograd.Function):
        """Identity whose forward and backward take a fixed wall time (a layer's compute, immune to
        other load on the machine, so the schedule's bubble shows alone)."""

        @staticmethod
        def forward(ctx: Any, x: Any, fwd_s: float, bwd_s: float) -> Any:
            ctx.bwd_s = bwd_s
            time.sleep(fwd_s)
            return x.clone()

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            time.sleep(ctx.bwd_s)
            return grad, None, None

    class SleepBlock(nn.Module):
        """A small linear layer followed by a fixed-time forward/backward."""

        def __init__(self, width: int, fwd_ms: float, bwd_ms: float) -> None:
            super().__init__()
            self.lin = nn.Linear(width, width)
            self.fwd_s, self.bwd_s = fwd_ms / 1000, bwd_ms / 1000

        def forward(self, x: Any) -> Any:
            return _Sleep.apply(self.lin(x), self.fwd_s, self.bwd_s)

    return SleepBlock


def _config(args: dict[str, Any], schedule: str | None, virtual: int) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": args["micro"],
        "gradient_accumulation_steps": args["m"],
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "steps_per_print": 10**9,
    }
    if schedule is not None:
        cfg["pipeline"] = {"schedule": schedule, "virtual_stages": virtual}
    return cfg


def _batches(args: dict[str, Any], torch: Any) -> list[tuple[Any, Any]]:
    gen = torch.Generator().manual_seed(0)
    return [
        (
            torch.randn(args["micro"], args["width"], generator=gen),
            torch.randn(args["micro"], args["width"], generator=gen),
        )
        for _ in range(args["m"])
    ]


def _time_steps(engine: Any, batches: list[Any], steps: int, barrier: Any) -> list[float]:
    times = []
    for i in range(steps + 2):
        barrier()
        start = time.perf_counter()
        engine.train_batch(iter(batches))
        if i >= 2:  # warm-up: torch's shape inference and the first allocations
            times.append(time.perf_counter() - start)
    return times


def _chunk_time(chunks: list[Any], x: Any, torch: Any, repeats: int = 5) -> float:
    """One micro batch's forward and backward through this rank's chunks, no pipeline around them."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for chunk in chunks:
            inp = x.detach().requires_grad_(True)
            out = chunk(inp)
            out.backward(torch.ones_like(out))
        best = min(best, time.perf_counter() - start)
    return best


def shardwise_rank(rank: int, world: int, case: tuple[str, int], args: dict[str, Any]) -> dict[str, Any]:
    """One schedule on this rank: step times and the isolated per-micro-batch compute time."""
    import torch
    from torch import nn

    import shardwise
    from shardwise.pipe import LayerSpec, PipelineModule

    schedule, virtual = case
    torch.manual_seed(0)
    net = PipelineModule(
        _layers(args, LayerSpec, nn), num_stages=world, loss_fn=nn.MSELoss(), partition_method="uniform"
    )
    engine, *_ = shardwise.initialize(model=net, config=_config(args, schedule, virtual))
    batches = _batches(args, torch)
    times = _time_steps(engine, batches, args["steps"], torch.distributed.barrier)
    torch.distributed.barrier()
    engine.optimizer.prepare_backward(False)  # local backwards only: ZeRO accumulates, reduces nothing
    t_mb = _chunk_time([c.submod for c in engine.executor.stages], batches[0][0], torch)
    engine.optimizer.after_backward()
    engine.optimizer.zero_grad()
    return {"step": min(times), "t_mb": t_mb}


def deepspeed_rank(args: dict[str, Any]) -> None:
    """DeepSpeed's PipelineEngine on this rank (run under torch.distributed.run from --ds-python)."""
    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.pipe import LayerSpec, PipelineModule
    from torch import nn

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    net = PipelineModule(
        _layers(args, LayerSpec, nn),
        num_stages=dist.get_world_size(),
        loss_fn=nn.MSELoss(),
        partition_method="uniform",
    )
    engine, *_ = deepspeed.initialize(
        model=net, config=_config(args, None, 1), model_parameters=net.parameters()
    )
    batches = _batches(args, torch)
    times = _time_steps(engine, batches, args["steps"], dist.barrier)
    dist.barrier()
    x = batches[0][0]
    t_mb = _chunk_time([lambda inp: net(inp)], x, torch)
    result = {"step": min(times), "t_mb": t_mb}
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, result)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(out), flush=True)


def _run_deepspeed(ds_python: str, args: dict[str, Any]) -> list[dict[str, Any]] | str:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": ""}
    cmd = [
        ds_python,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        __file__,
        "--ds-worker",
        json.dumps(args),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    return f"DeepSpeed run failed (exit {proc.returncode}): {(proc.stderr or proc.stdout)[-800:]}"


def _theory(schedule: str, p: int, m: int, v: int) -> float:
    if schedule in ("1f1b", "gpipe", "deepspeed"):
        return (p - 1) / (m + p - 1)
    if schedule == "interleaved_1f1b":
        return (p - 1) / (v * m + p - 1)
    return 0.0


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--ds-python", default=None, help="an interpreter with DeepSpeed 0.19.8 (adds its column)"
    )
    parser.add_argument("--ds-worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--micro", type=int, default=64, help="samples per micro batch")
    parser.add_argument(
        "--workload",
        choices=["sleep", "mlp"],
        default="sleep",
        help="sleep: each block's forward/backward takes a fixed wall time (the default: the "
        "bubble shows whatever else loads the machine); mlp: real matmuls",
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="repeats of every schedule (least step time kept)"
    )
    parser.add_argument("--fwd-ms", type=float, default=10.0, help="sleep workload: forward time per block")
    parser.add_argument("--bwd-ms", type=float, default=20.0, help="sleep workload: backward time per block")
    parsed = parser.parse_args()
    if parsed.ds_worker:
        deepspeed_rank(json.loads(parsed.ds_worker))
        return
    from shardwise.testing import run_distributed_cases

    ms = [4] if parsed.quick else [4, 8]
    steps = 4 if parsed.quick else 8
    rows = []
    for m in ms:
        args = {
            "width": parsed.width,
            "blocks": parsed.blocks,
            "micro": parsed.micro,
            "m": m,
            "steps": steps,
            "workload": parsed.workload,
            "fwd_ms": parsed.fwd_ms,
            "bwd_ms": parsed.bwd_ms,
        }
        # rounds in one job, the order reversed every round; each schedule keeps its least step time
        cases = [
            case for r in range(parsed.rounds) for case in (SCHEDULES if r % 2 == 0 else SCHEDULES[::-1])
        ]
        results = run_distributed_cases(shardwise_rank, cases, world_size=2, args=(args,), timeout=3000)
        best: dict[tuple[str, int], list[dict[str, Any]]] = {}
        for case, per_rank in zip(cases, results):
            if case not in best or max(r["step"] for r in per_rank) < max(r["step"] for r in best[case]):
                best[case] = per_rank
        for name, v in SCHEDULES:
            rows.append((m, f"shardwise {name}", v, best[(name, v)]))
        if parsed.ds_python:
            runs = [_run_deepspeed(parsed.ds_python, args) for _ in range(parsed.rounds)]
            done = [r for r in runs if isinstance(r, list)]
            rows.append(
                (
                    m,
                    "deepspeed 1f1b",
                    1,
                    min(done, key=lambda r: max(x["step"] for x in r)) if done else runs[0],
                )
            )
    shape = (
        f"{parsed.blocks} sleep blocks ({parsed.fwd_ms:g} ms forward, {parsed.bwd_ms:g} ms backward each)"
        if parsed.workload == "sleep"
        else f"{parsed.blocks} MLP blocks of width {parsed.width}, {parsed.micro} samples per micro batch"
    )
    print(f"2 stages, {shape}; step = least train_batch wall time over {parsed.rounds} rounds")
    print(f"{'m':>3} {'schedule':<30} {'step ms':>8} {'vs ds/1f1b':>10} {'bubble':>7} {'theory':>7}")
    base: dict[int, float] = {}
    for m, name, _, per_rank in rows:
        if isinstance(per_rank, list):
            step = max(r["step"] for r in per_rank)
            if name in ("deepspeed 1f1b",) or (name == "shardwise 1f1b" and m not in base):
                base[m] = step
    for m, name, v, per_rank in rows:
        if isinstance(per_rank, str):
            print(f"{m:>3} {name:<30} {per_rank}")
            continue
        step = max(r["step"] for r in per_rank)
        bubble = statistics.mean(1 - m * r["t_mb"] / r["step"] for r in per_rank)
        theory = _theory(name.split(" ", 1)[1], 2, m, v)
        print(f"{m:>3} {name:<30} {1000 * step:>8.1f} {base[m] / step:>10.2f} {bubble:>7.1%} {theory:>7.1%}")


if __name__ == "__main__":
    main()
