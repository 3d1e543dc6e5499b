"""Activation-checkpointing benchmark: shardwise against no checkpointing, ``torch.utils.checkpoint``
used directly, and DeepSpeed's ``deepspeed.checkpointing``, in one invocation::

    python benchmarks/activation_checkpointing_bench.py            # the 17M GPT, about 3-5 minutes
    python benchmarks/activation_checkpointing_bench.py --quick    # a small GPT, under a minute
    python benchmarks/activation_checkpointing_bench.py --ds-python /path/to/.venv-ds/bin/python

Workload: ``gpt_17m()`` (8 blocks) with a checkpoint per block, 2 gloo ranks forming one
model-parallel group (both train the same replica on the same batches, as tensor-parallel ranks
hold the same activations), zero_grad + forward + backward + AdamW step. Per peer, from
``saved_tensors_hooks`` accounting (parameters excluded, each storage once; see
``shardwise/checkpointing/meter.py``): the saved-activation bytes held at the end of the forward
(what checkpointing exists to cut), and the peak over forward and backward (which includes one
block's recomputed activations); and the step time: ``cpu ms``, the least CPU time of a rank's
step (``time.process_time``: the work done, which other load on a shared machine barely moves;
the ``overhead`` column and the target use it), and the wall time's min and median. Peers:

* ``none``: no checkpointing;
* ``torch``: ``torch.utils.checkpoint.checkpoint(block, x, use_reentrant=True)``;
* ``shardwise`` / ``shardwise_partition``: ``shardwise.checkpointing.checkpoint`` configured from a
  ds_config with ``partition_activations`` false / true;
* ``deepspeed`` / ``deepspeed_partition``: ``deepspeed.checkpointing.checkpoint``, configured the
  same way, from the ``.venv-ds`` environment (``make bench-setup``) with ``DS_ACCELERATOR=cpu``.
  When that interpreter is missing or cannot import deepspeed, those rows say why.

Every peer's losses are compared with ``none``'s (the recompute must not change the numbers).

Separate processes differ by a few percent in CPU time per step whatever they run (memory layout,
which core, neighbours), which is the size of the differences between the checkpointing peers. So
the run ends with an interleaved comparison: one process (DeepSpeed's venv, shardwise imported
from ``src``) in which none, torch, shardwise and DeepSpeed take turns on the same model and batch,
order reversed every round, min CPU time of forward + backward per peer.
Target (issue 14): shardwise saves as much memory as DeepSpeed at no more time overhead.
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

from rank_processes import free_port  # this script's directory is on sys.path

REPO = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "activation_checkpointing_worker.py"
MODELS = REPO / "src" / "shardwise" / "testing" / "models.py"
METER = REPO / "src" / "shardwise" / "checkpointing" / "meter.py"
DEFAULT_DS_PYTHON = REPO / ".venv-ds" / "bin" / "python"
WORLD = 2
PEERS = ["none", "torch", "shardwise", "deepspeed", "shardwise_partition", "deepspeed_partition"]
GPT_17M = {"vocab_size": 8192, "block_size": 128, "n_layer": 8, "n_head": 6, "n_embd": 384}
FULL = {"model": GPT_17M, "batch": (4, 128), "warmup": 2, "steps": 6}
QUICK = {
    "model": {"vocab_size": 1024, "block_size": 64, "n_layer": 4, "n_head": 4, "n_embd": 128},
    "batch": (4, 64),
    "warmup": 1,
    "steps": 3,
}


def launch(
    spec: dict[str, Any], python: str, env_extra: dict[str, str], timeout: float, world: int = WORLD
) -> list[dict[str, Any]]:
    """Run the ``world`` ranks of one peer; their results, or RuntimeError with the first rank's error."""
    with tempfile.TemporaryDirectory(prefix="act_ckpt_") as tmp:
        port, procs = free_port(), []
        for rank in range(world):
            env = dict(os.environ, **env_extra)
            env.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                OMP_NUM_THREADS="1",
                MKL_NUM_THREADS="1",
            )
            rank_spec = dict(spec, out=str(Path(tmp) / f"rank{rank}.json"))
            log = open(Path(tmp) / f"rank{rank}.log", "wb")  # noqa: SIM115 - the child holds it
            procs.append(
                subprocess.Popen(
                    [python, str(WORKER), json.dumps(rank_spec)],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.returncode not in (None, 0) for p in procs):
                time.sleep(2.0)  # let the partner write its error too, then stop it
                break
            time.sleep(0.1)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        results = []
        for rank in range(world):
            out = Path(tmp) / f"rank{rank}.json"
            if not out.exists():
                err = Path(str(out) + ".error")
                text = err.read_text() if err.exists() else (Path(tmp) / f"rank{rank}.log").read_text()
                lines = [ln for ln in text.strip().splitlines() if ln.strip()]
                raise RuntimeError(f"rank {rank}: {lines[-1] if lines else 'no output (timed out?)'}")
            results.append(json.loads(out.read_text()))
        return results


def _probe_deepspeed(python: str) -> str | None:
    """None when ``python`` imports deepspeed, else why not."""
    if not Path(python).exists():
        return f"{python} missing (run `make bench-setup`, or pass --ds-python)"
    done = subprocess.run(
        [python, "-c", "import deepspeed"],
        env=dict(os.environ, DS_ACCELERATOR="cpu"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        return f"deepspeed does not import under {python}: {lines[-1] if lines else done.returncode}"
    return None


def _fmt_row(name: str, r: dict[str, Any] | None, base: dict[str, Any] | None, why: str = "") -> str:
    if r is None:
        return f"{name:<22} {'skipped: ' + why}"
    held, peak = r["held_after_forward"] / 2**20, r["peak_saved_bytes"] / 2**20
    saving = 1 - r["held_after_forward"] / base["held_after_forward"] if base else 0.0
    overhead = r["cpu_s_min"] / base["cpu_s_min"] - 1 if base else 0.0
    same = "yes" if base and r["losses"] == base["losses"] else ("-" if base is None else "NO")
    return (
        f"{name:<22} {held:>9.2f} {saving:>7.1%} {peak:>9.2f} {r['cpu_s_min'] * 1000:>9.1f} "
        f"{r['step_s_min'] * 1000:>9.1f} {r['step_s'] * 1000:>9.1f} {overhead:>+9.1%}   {same}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small GPT and fewer steps")
    parser.add_argument("--ds-python", default=str(DEFAULT_DS_PYTHON), help="interpreter with deepspeed")
    parser.add_argument("--peers", nargs="+", default=PEERS, choices=PEERS)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per peer")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument(
        "--no-interleaved", action="store_true", help="skip the one-process interleaved comparison"
    )
    args = parser.parse_args(argv)
    preset = QUICK if args.quick else FULL
    spec = dict(preset, models_path=str(MODELS), meter_path=str(METER))
    src_env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")]))}
    ds_missing = (
        _probe_deepspeed(args.ds_python) if any(p.startswith("deepspeed") for p in args.peers) else None
    )
    if ds_missing:
        print(f"DeepSpeed peers skipped: {ds_missing}")
    results: dict[str, dict[str, Any] | None] = {}
    why: dict[str, str] = {}
    for peer in args.peers:
        if peer.startswith("deepspeed") and ds_missing:
            results[peer], why[peer] = None, ds_missing
            continue
        python, env = (
            (args.ds_python, {"DS_ACCELERATOR": "cpu"})
            if peer.startswith("deepspeed")
            else (sys.executable, src_env)
        )
        print(f"running {peer} ...", flush=True)
        try:
            ranks = launch(dict(spec, peer=peer), python, env, args.timeout)
        except RuntimeError as exc:
            results[peer], why[peer] = None, f"failed: {exc}"
            continue
        # per rank: the larger memory peak and the slower step (the job waits for it)
        results[peer] = {
            "peak_saved_bytes": max(r["peak_saved_bytes"] for r in ranks),
            "held_after_forward": max(r["held_after_forward"] for r in ranks),
            "step_s": max(r["step_s"] for r in ranks),
            "step_s_min": max(r["step_s_min"] for r in ranks),
            "cpu_s_min": max(r["cpu_s_min"] for r in ranks),
            "losses": ranks[0]["losses"],
            "per_rank": ranks,
        }
    model = preset["model"]
    print(
        f"\nGPT {model['n_layer']} blocks x {model['n_embd']} wide, vocab {model['vocab_size']}, micro batch "
        f"{preset['batch'][0]} x {preset['batch'][1]} tokens, {WORLD} gloo ranks (one model-parallel group), "
        f"median of {preset['steps']} steps after {preset['warmup']} warm-up"
    )
    print(
        f"{'peer':<22} {'held MiB':>9} {'saving':>7} {'peak MiB':>9} {'cpu ms':>9} {'min ms':>9} {'median ms':>9} "
        f"{'overhead':>9}   same losses"
    )
    base = results.get("none")
    for peer in args.peers:
        print(_fmt_row(peer, results[peer], base, why.get(peer, "")))
    _print_targets(results)
    inter = None
    if not ds_missing and not args.no_interleaved:
        inter = _interleaved(spec, args, src_env)
    if args.out:
        out = {"preset": preset, "results": results, "why": why, "interleaved": inter}
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


def _interleaved(
    spec: dict[str, Any], args: argparse.Namespace, src_env: dict[str, str]
) -> dict[str, Any] | None:
    """The four single-rank peers taking turns in one process (DeepSpeed's venv, shardwise from src)."""
    print(
        "\nrunning interleaved (one process: none / torch / shardwise / deepspeed take turns) ...", flush=True
    )
    env = dict(src_env, DS_ACCELERATOR="cpu")
    job = dict(spec, peer="interleaved", steps=max(spec["steps"], 6))
    try:
        (first,) = launch(job, args.ds_python, env, args.timeout, world=1)
    except RuntimeError as exc:
        print(f"interleaved comparison failed: {exc}")
        return None
    mins = first["cpu_s_min"]
    base = mins["none"]
    print(
        f"{'peer':<12} {'cpu ms':>9} {'overhead':>9}   (min over {job['steps']} rounds, forward + backward)"
    )
    for name, value in mins.items():
        print(f"{name:<12} {value * 1000:>9.1f} {value / base - 1:>+9.1%}")
    ok = mins["shardwise"] <= mins["deepspeed"] * 1.01
    print(
        f"shardwise vs deepspeed, same process: {mins['shardwise'] / mins['deepspeed']:.3f}x "
        f"({'PASS' if ok else 'FAIL'}: overhead no larger than DeepSpeed's, 1% noise allowed)"
    )
    return first


def _print_targets(results: dict[str, dict[str, Any] | None]) -> None:
    """shardwise vs DeepSpeed: memory saving at least as large, time overhead no larger."""
    base = results.get("none")
    if base is None:
        return
    for ours, theirs in (("shardwise", "deepspeed"), ("shardwise_partition", "deepspeed_partition")):
        a, b = results.get(ours), results.get(theirs)
        if a is None or b is None:
            continue
        mem_ok = a["held_after_forward"] <= b["held_after_forward"]
        over_a = a["cpu_s_min"] / base["cpu_s_min"] - 1
        over_b = b["cpu_s_min"] / base["cpu_s_min"] - 1
        ratio = a["cpu_s_min"] / b["cpu_s_min"]
        print(
            f"{ours} vs {theirs}: held after forward {a['held_after_forward'] / b['held_after_forward']:.3f}x, "
            f"peak {a['peak_saved_bytes'] / b['peak_saved_bytes']:.3f}x "
            f"({'PASS' if mem_ok else 'FAIL'}), step CPU time {ratio:.3f}x, overhead {over_a:+.1%} vs {over_b:+.1%} "
            f"({'PASS' if over_a <= over_b + 0.02 else 'FAIL'}; 2 points of timing noise allowed)"
        )


if __name__ == "__main__":
    raise SystemExit(main())
