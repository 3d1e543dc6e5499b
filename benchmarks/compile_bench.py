"""Compile benchmark: ``engine.compile()`` (each transformer block under ``torch.compile``) against
eager, at ZeRO stages 0-3, on 2 CPU ranks (gloo)::

    python benchmarks/compile_bench.py                      # inductor, stages 0-3, the quick GPT
    python benchmarks/compile_bench.py --model 17m          # the engine benchmark's GPT (gpt_17m)
    python benchmarks/compile_bench.py --backend aot_eager  # parity of AOT autograd alone (exact)
    python benchmarks/compile_bench.py --stages 3 --steps 20 --out compile.json

Each stage is its own 2-process job (``compile_worker.py``): both engines, eager and compiled, built
from the same seed in each rank and stepped on the same batches, alternating which goes first. Per
stage it prints the median step time after ``--warmup`` steps (wall and CPU time, rank 0), the ratio
compiled / eager (below 1: compiling is faster), the first compiled step (which compiles), and the
largest difference of the two runs' losses over all steps (parity: ``aot_eager`` is exact by
construction; inductor fuses kernels, so its losses drift by fp32 rounding).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rank_processes import run_json_ranks

WORKER = Path(__file__).resolve().parent / "compile_worker.py"
MODELS = {
    # engine_core.py --quick's GPT
    "quick": {"vocab_size": 2048, "block_size": 64, "n_layer": 2, "n_head": 4, "n_embd": 128},
    # engine_core.py's gpt_17m
    "17m": {"vocab_size": 8192, "block_size": 128, "n_layer": 8, "n_head": 6, "n_embd": 384},
}


def run_stage(spec: dict, timeout: float) -> list[dict]:
    """Both ranks of one stage; their JSON results (RuntimeError with the first error otherwise)."""
    cmd = [sys.executable, str(WORKER), "--spec", json.dumps(spec)]
    return run_json_ranks(cmd, 2, timeout, f"stage {spec['stage']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="quick")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, nargs=2, default=[2, 32], metavar=("MICRO", "SEQ"))
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--out", help="write every rank's results as JSON")
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error("--steps must exceed --warmup")
    rows = []
    print(f"model {args.model} {json.dumps(MODELS[args.model])}, batch {args.batch}, backend {args.backend}, "
          f"{args.steps} steps ({args.warmup} warm-up), 2 ranks")
    print(f"{'stage':>5} | {'eager ms':>9} | {'compiled ms':>11} | {'ratio':>6} | {'cpu ratio':>9} | "
          f"{'compile s':>9} | {'max |loss diff|':>15}")
    for stage in args.stages:
        spec = {"model": MODELS[args.model], "batch": args.batch, "stage": stage, "steps": args.steps,
                "warmup": args.warmup, "backend": args.backend}
        ranks = run_stage(spec, args.timeout)
        r = ranks[0]
        diff = max(x["max_loss_diff"] for x in ranks)
        print(f"{stage:>5} | {r['eager_wall_ms']:>9.1f} | {r['compiled_wall_ms']:>11.1f} | "
              f"{r['compiled_wall_ms'] / r['eager_wall_ms']:>6.2f} | {r['compiled_cpu_ms'] / r['eager_cpu_ms']:>9.2f} | "
              f"{r['compile_s']:>9.1f} | {diff:>15.3g}", flush=True)
        rows.append({"spec": spec, "ranks": ranks})
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
