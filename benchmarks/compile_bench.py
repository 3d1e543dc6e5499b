"""Compile benchmark: ``engine.compile()`` (each transformer block under ``torch.compile``) against
eager, at ZeRO stages 0-3, on 2 CPU ranks (gloo)::

    python benchmarks/compile_bench.py                      # inductor, stages 0-3, the quick GPT
    python benchmarks/compile_bench.py --model 17m          # the engine benchmark's GPT (gpt_17m)
    python benchmarks/compile_bench.py --backend aot_eager  # parity of AOT autograd alone (exact)
    python benchmarks/compile_bench.py --stages 3 --steps 20 --out compile.json
    python benchmarks/compile_bench.py --model 17m --eager-env ATEN_CPU_CAPABILITY=avx2  # eager vs eager

Each stage is its own 2-process job (``compile_worker.py``): both engines, eager and compiled, built
from the same seed in each rank and stepped on the same batches, alternating which goes first. Per
stage it prints the median step time after ``--warmup`` steps (wall and CPU time, rank 0), the ratio
compiled / eager (below 1: compiling is faster), the first compiled step (which compiles), and the
largest difference of the two runs' losses over all steps (parity: ``aot_eager`` is exact by
construction; inductor fuses kernels, so its losses drift by fp32 rounding), and over the first 5
steps (where a difference is still one rounding, not yet amplified by training).

``--eager-env KEY=VALUE ...`` measures that drift's scale without any compiler: per stage, eager
alone twice, once as is and once with these variables set (``ATEN_CPU_CAPABILITY=avx2`` makes
ATen's vectorised kernels use 8 lanes instead of AVX-512's 16, so its reductions sum in another,
equally valid order; ``MKL_CBWR=COMPATIBLE`` does the same to MKL's matmuls), and the same loss
differences between the two.
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


def run_stage(spec: dict, timeout: float, **env: str) -> list[dict]:
    """Both ranks of one stage; their JSON results (RuntimeError with the first error otherwise)."""
    cmd = [sys.executable, str(WORKER), "--spec", json.dumps(spec)]
    return run_json_ranks(cmd, 2, timeout, f"stage {spec['stage']}", **env)


def eager_vs_eager(spec: dict, timeout: float, env: dict[str, str]) -> list[dict]:
    """Eager alone, as is and with ``env``; per rank both runs' losses and their differences."""
    plain, varied = run_stage(spec, timeout), run_stage(spec, timeout, **env)
    return [{"rank": a["rank"], "losses": a["eager_losses"], "env_losses": b["eager_losses"],
             "loss_diffs": [abs(x - y) for x, y in zip(a["eager_losses"], b["eager_losses"])]}
            for a, b in zip(plain, varied)]  # fmt: skip


def env_pairs(pairs: list[str]) -> dict[str, str]:
    """``KEY=VALUE`` strings as a dict (ValueError naming the bad one)."""
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--eager-env {pair!r}: expected KEY=VALUE, e.g. ATEN_CPU_CAPABILITY=avx2")
        env[key] = value
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="quick")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, nargs=2, default=[2, 32], metavar=("MICRO", "SEQ"))
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--eager-env", nargs="+", metavar="KEY=VALUE",
                        help="no compiler: eager as is against eager with these environment variables")
    parser.add_argument("--out", help="write every rank's results as JSON")
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error("--steps must exceed --warmup")
    rows = []
    if args.eager_env:
        try:
            env = env_pairs(args.eager_env)
        except ValueError as exc:
            parser.error(str(exc))
        print(f"model {args.model}, batch {args.batch}: eager vs eager with {env}, {args.steps} steps, 2 ranks")
        print(f"{'stage':>5} | {'max |loss diff| steps 0-4':>25} | {'max |loss diff|':>15}")
        for stage in args.stages:
            spec = {"model": MODELS[args.model], "batch": args.batch, "stage": stage, "steps": args.steps,
                    "warmup": args.warmup, "backend": None}
            ranks = eager_vs_eager(spec, args.timeout, env)
            early = max(max(r["loss_diffs"][:5]) for r in ranks)
            print(f"{stage:>5} | {early:>25.3g} | {max(max(r['loss_diffs']) for r in ranks):>15.3g}", flush=True)
            rows.append({"spec": spec, "env": env, "ranks": ranks})
        if args.out:
            Path(args.out).write_text(json.dumps(rows, indent=1))
        return
    print(f"model {args.model} {json.dumps(MODELS[args.model])}, batch {args.batch}, backend {args.backend}, "
          f"{args.steps} steps ({args.warmup} warm-up), 2 ranks")
    print(f"{'stage':>5} | {'eager ms':>9} | {'compiled ms':>11} | {'ratio':>6} | {'cpu ratio':>9} | "
          f"{'compile s':>9} | {'max |loss diff| steps 0-4':>25} | {'max |loss diff|':>15}")
    for stage in args.stages:
        spec = {"model": MODELS[args.model], "batch": args.batch, "stage": stage, "steps": args.steps,
                "warmup": args.warmup, "backend": args.backend}
        ranks = run_stage(spec, args.timeout)
        r = ranks[0]
        diff = max(x["max_loss_diff"] for x in ranks)
        early = max(max(x["loss_diffs"][:5]) for x in ranks)
        print(f"{stage:>5} | {r['eager_wall_ms']:>9.1f} | {r['compiled_wall_ms']:>11.1f} | "
              f"{r['compiled_wall_ms'] / r['eager_wall_ms']:>6.2f} | {r['compiled_cpu_ms'] / r['eager_cpu_ms']:>9.2f} | "
              f"{r['compile_s']:>9.1f} | {early:>25.3g} | {diff:>15.3g}", flush=True)
        rows.append({"spec": spec, "ranks": ranks})
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
