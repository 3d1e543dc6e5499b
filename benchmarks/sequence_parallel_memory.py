"""Sequence-parallel memory: Ulysses SP=2 vs SP=1, TiledMLP vs the plain MLP, longest sequence in a budget.

    python benchmarks/sequence_parallel_memory.py [--ds-python /work/venv-ds/bin/python] [--seq 4096]

Runs ``sequence_parallel_memory_worker.py`` (a small Llama-style decoder, Ulysses around SDPA; see its
docstring for what is measured) on CPU gloo ranks, against shardwise's ``deepspeed`` package (written
into a throwaway directory by ``shardwise compat install-deepspeed``) and, with ``--ds-python``,
against real DeepSpeed 0.19.8 (``DS_ACCELERATOR=cpu``). Per side it reports, per rank:

* saved activation bytes at ``--seq`` with SP=2 over SP=1 (the issue's bound: <= 0.55);
* TiledMLP's peak temporary memory over the plain MLP's on the same tokens (bound: <= 1/4), where
  temporary is the rise of resident memory during forward + backward (input and upstream gradient
  already resident) minus the output and the input's gradient, which any MLP makes; the raw rises
  are printed too;
* the longest sequence that fits the memory the baseline (SP=1, plain MLP and loss) uses at
  ``--seq`` with ALST (SP=2 + TiledMLP + TiledFusedLogitsLoss), as a ratio to ``--seq``: peak
  resident memory is measured at ``--seq / 2`` and ``--seq`` and extrapolated linearly (SDPA's CPU
  kernel keeps attention linear in the length), then the predicted length is run and its measured
  peak reported next to the budget.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rank_processes import free_port, last_error_line, wait_ranks

REPO = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "sequence_parallel_memory_worker.py"
METER = REPO / "src" / "shardwise" / "checkpointing" / "meter.py"
MODEL = {"hidden": 128, "heads": 4, "intermediate": 512, "vocab": 2048, "layers": 2}


def launch(spec: dict[str, Any], python: str, env_extra: dict[str, str], world: int, timeout: float = 900) -> list[dict]:
    """Run ``world`` ranks of the worker; their results, or RuntimeError naming the first failure."""
    with tempfile.TemporaryDirectory(prefix="sp_mem_") as tmp:
        port, procs = free_port(), []
        for rank in range(world):
            env = dict(os.environ, **env_extra)
            env.update(
                RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
                MALLOC_MMAP_THRESHOLD_="131072",  # fixed: freed large tensors give their pages back
            )
            rank_spec = dict(spec, out=str(Path(tmp) / f"rank{rank}.json"), meter_path=str(METER))
            log = open(Path(tmp) / f"rank{rank}.log", "wb")  # noqa: SIM115 - the child holds it
            procs.append(subprocess.Popen([python, str(WORKER), json.dumps(rank_spec)], env=env, stdout=log,
                                          stderr=subprocess.STDOUT))
        wait_ranks(procs, time.monotonic() + timeout, grace=2.0, poll=0.1)
        results = []
        for rank in range(world):
            out = Path(tmp) / f"rank{rank}.json"
            if not out.exists():
                err = Path(str(out) + ".error")
                text = err.read_text() if err.exists() else (Path(tmp) / f"rank{rank}.log").read_text()
                raise RuntimeError(f"rank {rank}: {last_error_line(text)}")
            results.append(json.loads(out.read_text()))
        return results


def measure(python: str, env: dict[str, str], seq: int, world: int, tiled: bool) -> dict[str, float]:
    """Rank 0's numbers (the ranks hold equal slices; the maximum over ranks is taken)."""
    ranks = launch({**MODEL, "seq": seq, "tiled": tiled}, python, env, world)
    return {key: max(r[key] for r in ranks) for key in ("saved_bytes", "peak_rss_delta", "mlp_peak_delta", "mlp_io_bytes")}


def side(name: str, python: str, env: dict[str, str], seq: int) -> dict[str, Any]:
    """Every number of one side."""
    print(f"[{name}] measuring", flush=True)
    sp1 = measure(python, env, seq, 1, tiled=False)
    sp2 = measure(python, env, seq, 2, tiled=False)
    tiled1 = measure(python, env, seq, 1, tiled=True)
    half_base = measure(python, env, seq // 2, 1, tiled=False)
    half_alst = measure(python, env, seq // 2, 2, tiled=True)
    alst = measure(python, env, seq, 2, tiled=True)
    budget = sp1["peak_rss_delta"]
    slope = (alst["peak_rss_delta"] - half_alst["peak_rss_delta"]) / (seq - seq // 2)
    fixed = alst["peak_rss_delta"] - slope * seq
    longest = int((budget - fixed) / slope) // 256 * 256 if slope > 0 else seq
    # the linear model is checked at twice --seq (a run at the predicted length itself is made only when it
    # is at most that: dense attention's time grows with the square of the length, too slow on one CPU thread)
    double = measure(python, env, 2 * seq, 2, tiled=True)
    check = measure(python, env, longest, 2, tiled=True) if longest <= 2 * seq else None
    base_slope = (sp1["peak_rss_delta"] - half_base["peak_rss_delta"]) / (seq - seq // 2)
    temp = lambda m: max(0.0, m["mlp_peak_delta"] - m["mlp_io_bytes"])  # noqa: E731
    return {
        "side": name,
        "saved_sp1": sp1["saved_bytes"],
        "saved_sp2": sp2["saved_bytes"],
        "saved_ratio": sp2["saved_bytes"] / sp1["saved_bytes"],
        "mlp_peak_plain": sp1["mlp_peak_delta"],
        "mlp_peak_tiled": tiled1["mlp_peak_delta"],
        "mlp_temp_plain": temp(sp1),
        "mlp_temp_tiled": temp(tiled1),
        "mlp_ratio": temp(tiled1) / max(1.0, temp(sp1)),
        "budget": budget,
        "baseline_bytes_per_token": base_slope,
        "alst_bytes_per_token": slope,
        "longest_alst": longest,
        "longest_ratio": longest / seq,
        "longest_measured_peak": None if check is None else check["peak_rss_delta"],
        "alst_at_double_predicted": fixed + slope * 2 * seq,
        "alst_at_double_measured": double["peak_rss_delta"],
    }


def report(rows: list[dict[str, Any]], seq: int) -> str:
    """The table, one column per side."""
    mib = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
    lines = [f"sequence-parallel memory, seq {seq}, model {MODEL}, per rank", ""]
    header = f"{'':46}" + "".join(f"{r['side']:>22}" for r in rows)
    lines.append(header)
    fields = [
        ("saved activations, SP=1", lambda r: mib(r["saved_sp1"])),
        ("saved activations, SP=2", lambda r: mib(r["saved_sp2"])),
        ("  SP=2 / SP=1 (bound <= 0.55)", lambda r: f"{r['saved_ratio']:.3f}"),
        ("MLP peak rise in fwd+bwd, plain / TiledMLP", lambda r: f"{mib(r['mlp_peak_plain'])} / {mib(r['mlp_peak_tiled'])}"),
        ("MLP peak temporary, plain", lambda r: mib(r["mlp_temp_plain"])),
        ("MLP peak temporary, TiledMLP", lambda r: mib(r["mlp_temp_tiled"])),
        ("  tiled / plain (bound <= 0.25)", lambda r: f"{r['mlp_ratio']:.3f}"),
        (f"budget: baseline peak at {seq}", lambda r: mib(r["budget"])),
        ("bytes per token, baseline / ALST", lambda r: f"{r['baseline_bytes_per_token']:.0f} / {r['alst_bytes_per_token']:.0f}"),
        ("longest ALST sequence in the budget", lambda r: str(r["longest_alst"])),
        (f"  linear model at {2 * seq}: predicted / measured", lambda r: f"{mib(r['alst_at_double_predicted'])} / {mib(r['alst_at_double_measured'])}"),
        ("  measured peak at the longest", lambda r: "not run" if r["longest_measured_peak"] is None else mib(r["longest_measured_peak"])),
        (f"  longest ratio ALST / baseline ({seq})", lambda r: f"{r['longest_ratio']:.2f}x"),
    ]
    for label, fmt in fields:
        lines.append(f"{label:46}" + "".join(f"{fmt(r):>22}" for r in rows))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--ds-python", help="an interpreter with real DeepSpeed 0.19.8 (adds its column)")
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="sp_mem_site_") as site:
        subprocess.run([sys.executable, "-m", "shardwise.cli.main", "compat", "install-deepspeed", "--target", site],
                       check=True, capture_output=True)
        rows.append(side("shardwise", sys.executable, {"PYTHONPATH": site}, args.seq))
    if args.ds_python:
        rows.append(side("deepspeed 0.19.8", args.ds_python, {"DS_ACCELERATOR": "cpu"}, args.seq))
    print(report(rows, args.seq))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
