"""MoE benchmark: shardwise's ``deepspeed.moe`` against DeepSpeed 0.19.8's on the same workload::

    python benchmarks/moe_bench.py --ds-python /work/venv-ds/bin/python [--quick]

Workload: 2 gloo ranks, ``ep_size=2`` (expert parallelism over both ranks), MoE layers of 8 experts
(FFN ``hidden -> 4 hidden -> hidden``), top-2 gating, capacity factor 1, a linear head; fp32, ZeRO
stage 1, AdamW from the split MoE parameter groups; each rank its own batch.

Reported per peer (rank 0): the bytes handed to ``all_to_all_single`` in one step, next to the
theory ``(4 x layers - 1) x E x C x M x 4`` bytes (two all-to-alls forward and two backward per
layer, each an ``[E, C, M]`` fp32 block, ``C = ceil(tokens / E x capacity_factor x k)``, less the
backward of the first layer's dispatch: its input needs no gradient; the part that leaves the
rank is ``(ep - 1) / ep`` of it); the least CPU time of a step (``time.process_time``, the work
done, which a shared machine's other load barely moves) and the median wall time; the step-time
ratio shardwise / DeepSpeed. The peers run one after the other, twice, in alternating order.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rank_processes import best_of_alternating, run_json_ranks

WORKER = Path(__file__).resolve().parent / "moe_worker.py"
FULL = {"hidden": 256, "ffn": 1024, "experts": 8, "ep": 2, "k": 2, "batch": 8, "seq": 128, "layers": 2,
        "stage": 1, "steps": 8, "warmup": 2}
QUICK = {**FULL, "hidden": 64, "ffn": 256, "batch": 4, "seq": 32, "steps": 4, "warmup": 1}


def run_peer(peer: str, python: str, spec: dict, timeout: float) -> list[dict]:
    """Both ranks of one peer; their JSON results (RuntimeError with the first error otherwise)."""
    cmd = [python, str(WORKER), "--peer", peer, "--spec", json.dumps(spec)]
    return run_json_ranks(cmd, 2, timeout, peer, DS_ACCELERATOR="cpu")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ds-python", default="/work/venv-ds/bin/python")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args()
    spec = QUICK if args.quick else FULL
    best = best_of_alternating(
        lambda peer: run_peer(peer, sys.executable if peer == "shardwise" else args.ds_python, spec, args.timeout)[0]
    )
    print(f"workload: {json.dumps(spec)}")
    print(f"{'peer':10} | {'a2a bytes/step':>14} | {'theory':>10} | {'cpu ms (min)':>12} | {'wall ms (median)':>16}")
    for peer, r in best.items():
        print(f"{peer:10} | {r['a2a_bytes_per_step']:>14} | {r['theory_bytes_per_step']:>10} | "
              f"{r['cpu_ms_min']:>12.1f} | {r['wall_ms_median']:>16.1f}")
    sw, ds = best["shardwise"], best["deepspeed"]
    print(f"step time ratio shardwise / DeepSpeed: cpu {sw['cpu_ms_min'] / ds['cpu_ms_min']:.2f}, "
          f"wall {sw['wall_ms_median'] / ds['wall_ms_median']:.2f}")
    print(json.dumps({"spec": spec, "results": best}))


if __name__ == "__main__":
    main()
