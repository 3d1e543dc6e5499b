"""Folded AutoEP + AutoTP benchmark: shardwise against DeepSpeed 0.19.8 on the same workload::

    python benchmarks/autoep_folding_bench.py --ds-python /work/venv-ds/bin/python [--quick] [--ep 2 4]

Workload: 4 gloo ranks, a Mixtral-shaped model (the folded test's, ``tests/distributed/autoep_folding_cases.build_model``: per layer a
column/row-parallel dense pair and a sparse block of 8 experts, top-2), ``tensor_parallel.autotp_size=2``
and ``expert_parallel.autoep_size`` = each ``--ep`` (folded expert groups are runs of consecutive ranks:
2: each TP pair is an expert group; 4: one expert group across both TP pairs), fp32, torch's Adam, ZeRO stage 1; each
data-parallel replica its own batch, the same on its two TP lanes.

Reported per peer (rank 0): the bytes handed to ``all_to_all_single`` in one step (the dispatch:
folded, each TP lane sends only its share of the routed assignments, so the ``tp`` copies of a token
are not dispatched ``tp`` times), the least CPU time of a step (``time.process_time``) and the median
wall time, the first and last loss; and the step-time ratio shardwise / DeepSpeed. The peers run one
after the other, twice, in alternating order.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rank_processes import best_of_alternating, run_json_ranks

WORKER = Path(__file__).resolve().parent / "autoep_folding_worker.py"
FULL = {"hidden": 256, "ffn": 512, "experts": 8, "k": 2, "layers": 2, "tokens": 512, "tp": 2, "stage": 1,
        "steps": 8, "warmup": 2}
QUICK = {**FULL, "hidden": 64, "ffn": 128, "tokens": 64, "steps": 3, "warmup": 1}
WORLD = 4


def run_peer(peer: str, python: str, spec: dict, timeout: float) -> dict:
    """Every rank of one peer; rank 0's JSON result (RuntimeError with the first error otherwise)."""
    cmd = [python, str(WORKER), "--peer", peer, "--spec", json.dumps(spec)]
    return run_json_ranks(cmd, WORLD, timeout, peer, DS_ACCELERATOR="cpu")[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ds-python", default="/work/venv-ds/bin/python")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--ep", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args()
    for ep in args.ep:
        spec = {**(QUICK if args.quick else FULL), "ep": ep}
        best = best_of_alternating(
            lambda peer, spec=spec: run_peer(peer, sys.executable if peer == "shardwise" else args.ds_python, spec,
                                             args.timeout)
        )
        print(f"workload: {json.dumps(spec)} on {WORLD} ranks")
        print(f"{'peer':10} | {'a2a bytes/step':>14} | {'cpu ms (min)':>12} | {'wall ms (median)':>16} | loss first -> last")
        for peer, r in best.items():
            print(f"{peer:10} | {r['a2a_bytes_per_step']:>14} | {r['cpu_ms_min']:>12.1f} | {r['wall_ms_median']:>16.1f} | "
                  f"{r['losses'][0]:.6f} -> {r['losses'][-1]:.6f}")
        sw, ds = best["shardwise"], best["deepspeed"]
        print(f"step time ratio shardwise / DeepSpeed: cpu {sw['cpu_ms_min'] / ds['cpu_ms_min']:.2f}, "
              f"wall {sw['wall_ms_median'] / ds['wall_ms_median']:.2f}\n")


if __name__ == "__main__":
    main()
