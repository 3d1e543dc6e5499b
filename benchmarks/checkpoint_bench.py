"""Checkpoint benchmark: save/load time of the 17M-parameter GPT, shardwise vs DeepSpeed, and export RAM.

One command, 2 CPU ranks (gloo), the same model, optimizer state and ZeRO stage in both
frameworks::

    python benchmarks/checkpoint_bench.py              # gpt_17m, stage 2, fp32, 3 repeats
    python benchmarks/checkpoint_bench.py --stage 3    # the same at ZeRO stage 3
    python benchmarks/checkpoint_bench.py --quick      # a 0.7M-parameter GPT, 2 repeats
    python benchmarks/checkpoint_bench.py --out results.json

What is measured (rank 0's wall clock, between barriers, so the slowest rank counts):

* ``save``: ``engine.save_checkpoint(dir, tag)`` until every rank returned; shardwise also with
  ``checkpoint.async_save`` (time until training may continue, and until the files are published);
* ``load``: ``engine.load_checkpoint(dir, tag)`` into the same engine (shardwise's includes the
  checksum verification it runs before reading);
* ``verify`` (shardwise): that verification alone, as ``load_checkpoint`` runs it (every rank
  checks sizes, the summary and ``.metadata``, and reads the data files its rank number wrote),
  as a share of ``load``; loads alternating with and without that verification (what it
  adds, with drifting machine load hitting both alike); and one process verifying every file,
  as ``shardwise checkpoint verify`` does;
* ``bytes``: the tag directory on disk;
* export peak RSS: a fresh process converting the checkpoint to one fp32 file (shardwise's streaming
  ``export_checkpoint``; DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint`` on its own
  checkpoint, then ``torch.save``, as ``zero_to_fp32.py`` does), reported as ``ru_maxrss`` of that process and above its own baseline after imports.

This is a benchmark, not a test: nothing here asserts. DeepSpeed runs from ``.venv-ds``
(``make bench-setup``) with ``DS_ACCELERATOR=cpu``; if it is missing its rows say so.
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
DEFAULT_DS_PYTHON = REPO / ".venv-ds" / "bin" / "python"
WORLD = 2


# ---------------------------------------------------------------------------- rank side
def _models() -> Any:
    """``shardwise/testing/models.py`` loaded by path: pure torch, so DeepSpeed's venv can use it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_models", REPO / "src/shardwise/testing/models.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_models"] = module
    spec.loader.exec_module(module)
    return module


def _config(stage: int, async_save: bool = False) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 100000,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": 1e-3,
                "betas": [0.9, 0.999],
                "eps": 1e-8,
                "weight_decay": 0.01,
                "torch_adam": True,
            },
        },
        "zero_optimization": {"stage": stage},
        "checkpoint": {"async_save": async_save} if async_save else {},
    }


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    models = _models()
    cfg = (
        models.gpt_17m()
        if not args.quick
        else models.GPTConfig(vocab_size=2048, block_size=32, n_layer=2, n_embd=128)
    )
    torch.manual_seed(1234)
    model = models.TinyGPT(cfg)
    rank = int(os.environ["RANK"])
    if args.framework == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        config = _config(args.stage)
        config.pop("checkpoint")
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    else:
        import shardwise

        engine, *_ = shardwise.initialize(
            model=model, model_parameters=model.parameters(), config=_config(args.stage, args.async_save)
        )
    gen = torch.Generator().manual_seed(rank)
    x = torch.randint(0, cfg.vocab_size, (2, 32), generator=gen)
    loss = engine(x, x)
    engine.backward(loss)
    engine.step()  # optimizer state exists from here on
    out: dict[str, Any] = {"save_s": [], "load_s": [], "return_s": []}
    for r in range(args.repeats):
        dist.barrier()
        start = time.perf_counter()
        engine.save_checkpoint(args.dir, tag=f"t{r}")
        out["return_s"].append(time.perf_counter() - start)
        if args.async_save:
            from shardwise.checkpoint import engine_io

            engine_io.wait_for_checkpoint(engine)
        dist.barrier()
        out["save_s"].append(time.perf_counter() - start)
    for r in range(args.repeats):
        dist.barrier()
        start = time.perf_counter()
        engine.load_checkpoint(args.dir, tag=f"t{r}")
        dist.barrier()
        out["load_s"].append(time.perf_counter() - start)
    if args.framework == "shardwise":
        from shardwise.checkpoint import integrity, integrity_ranks

        verify_before_load = integrity_ranks.verify_before_load
        out["load_verified_s"], out["load_unverified_s"] = [], []
        for r in range(args.repeats):  # alternating, so drifting machine load hits both alike
            for skip in (False, True):
                if skip:
                    integrity_ranks.verify_before_load = lambda *_: None  # type: ignore[assignment,return-value]
                dist.barrier()
                start = time.perf_counter()
                engine.load_checkpoint(args.dir, tag=f"t{r}")
                dist.barrier()
                out["load_unverified_s" if skip else "load_verified_s"].append(time.perf_counter() - start)
                integrity_ranks.verify_before_load = verify_before_load
        out["verify_s"], out["verify_all_s"] = [], []
        for r in range(args.repeats):
            dist.barrier()
            start = time.perf_counter()
            integrity_ranks.verify_before_load(Path(args.dir) / f"t{r}", None)
            dist.barrier()
            out["verify_s"].append(time.perf_counter() - start)
            if rank == 0:
                start = time.perf_counter()
                integrity.verify_tag(Path(args.dir) / f"t{r}")
                out["verify_all_s"].append(time.perf_counter() - start)
    # DeepSpeed's stage 3 empties the parameters in place; ds_numel keeps their size
    out["params"] = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    tag_dir = Path(args.dir) / "t0"
    out["bytes"] = sum(f.stat().st_size for f in tag_dir.rglob("*") if f.is_file())
    if rank == 0:
        Path(args.result).write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def export_worker(args: argparse.Namespace) -> None:
    """Convert a checkpoint to one fp32 file and report this process's peak RSS (KiB on Linux)."""
    import resource

    import torch  # the baseline includes torch, as any converter needs it

    if args.framework == "deepspeed":
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    else:
        from shardwise.checkpoint.export import export_checkpoint
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    if args.framework == "deepspeed":
        # what zero_to_fp32.py does without its optional huggingface_hub/safetensors imports
        torch.save(
            get_fp32_state_dict_from_zero_checkpoint(args.dir, tag="t0"), Path(args.out_dir) / "model.bin"
        )
    else:
        export_checkpoint(args.dir, Path(args.out_dir) / "model.safetensors", tag="t0", dtype="fp32")
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    Path(args.result).write_text(json.dumps({"base_kib": base, "peak_kib": peak, "seconds": seconds}))


# ---------------------------------------------------------------------------- driver side
def _env(python: Path, framework: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "src")}
    if framework == "deepspeed":
        env["DS_ACCELERATOR"] = "cpu"
    return env


def run_ranks(python: Path, framework: str, extra: list[str], timeout: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as scratch:
        result = Path(scratch) / "result.json"
        port = free_port()
        procs = []
        for rank in range(WORLD):
            env = {
                **_env(python, framework),
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(WORLD),
                "LOCAL_WORLD_SIZE": str(WORLD),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            }
            cmd = [
                str(python),
                __file__,
                "--role",
                "worker",
                "--framework",
                framework,
                "--result",
                str(result),
                *extra,
            ]
            procs.append(
                subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            )
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
        if any(p.returncode for p in procs) or not result.exists():
            tail = "\n".join(o[-1500:] for o in outputs)
            return {"error": f"exit codes {[p.returncode for p in procs]}: {tail}"}
        return json.loads(result.read_text())


def run_export(python: Path, framework: str, ckpt: Path, timeout: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as scratch:
        result = Path(scratch) / "export.json"
        cmd = [str(python), __file__, "--role", "export", "--framework", framework, "--dir", str(ckpt)]
        cmd += ["--out-dir", scratch, "--result", str(result)]
        proc = subprocess.run(
            cmd, env=_env(python, framework), capture_output=True, text=True, timeout=timeout
        )
        if proc.returncode or not result.exists():
            return {"error": (proc.stdout + proc.stderr)[-1500:]}
        return json.loads(result.read_text())


def _fmt_times(values: list[float]) -> str:
    return f"{min(values):7.2f} s (min of {len(values)}; max {max(values):.2f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=["driver", "worker", "export"], default="driver")
    parser.add_argument("--framework", choices=["shardwise", "deepspeed"], default="shardwise")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--dir", default=None)
    parser.add_argument("--out-dir", default=None)
    parser.add_argument("--result", default=None)
    parser.add_argument("--out", default=None, help="write all numbers as JSON here")
    parser.add_argument("--ds-python", default=str(DEFAULT_DS_PYTHON))
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args(argv)
    if args.repeats is None:
        args.repeats = 2 if args.quick else 3
    if args.role == "worker":
        worker(args)
        return 0
    if args.role == "export":
        export_worker(args)
        return 0

    me, ds = Path(sys.executable), Path(args.ds_python)
    common = ["--stage", str(args.stage), "--repeats", str(args.repeats)] + (
        ["--quick"] if args.quick else []
    )
    report: dict[str, Any] = {"stage": args.stage, "world_size": WORLD, "quick": args.quick}
    with tempfile.TemporaryDirectory() as root:
        runs = {
            "shardwise": (me, "shardwise", [*common, "--dir", f"{root}/sw"]),
            "shardwise async": (me, "shardwise", [*common, "--dir", f"{root}/swa", "--async-save"]),
            "deepspeed": (ds, "deepspeed", [*common, "--dir", f"{root}/ds"]),
        }
        for name, (python, framework, extra) in runs.items():
            if framework == "deepspeed" and not python.exists():
                report[name] = {"error": f"not available: {python} missing (make bench-setup)"}
                continue
            report[name] = run_ranks(python, framework, extra, args.timeout)
        report["export shardwise"] = run_export(me, "shardwise", Path(f"{root}/sw"), args.timeout)
        if ds.exists() and "error" not in report["deepspeed"]:
            report["export deepspeed (zero_to_fp32)"] = run_export(
                ds, "deepspeed", Path(f"{root}/ds"), args.timeout
            )

    print(
        f"Checkpoint benchmark: GPT {'quick' if args.quick else '17M'}, ZeRO stage {args.stage}, fp32, {WORLD} CPU ranks"
    )
    for name in ("shardwise", "shardwise async", "deepspeed"):
        row = report[name]
        if "error" in row:
            print(f"  {name:16s} {row['error'][:300]}")
            continue
        line = f"  {name:16s} save {_fmt_times(row['save_s'])}  load {_fmt_times(row['load_s'])}"
        line += f"  {row['bytes'] / 2**20:7.1f} MiB on disk  ({row['params']:,} params)"
        if name == "shardwise async":
            line += f"  training resumes after {min(row['return_s']):.2f} s"
        print(line)
        if "verify_s" in row:
            share = min(row["verify_s"]) / min(row["load_s"])
            added = min(row["load_verified_s"]) / min(row["load_unverified_s"]) - 1
            print(
                f"  {'':16s} verify alone {_fmt_times(row['verify_s'])} = {100 * share:.1f} % of load; "
                f"one process verifying every file: {min(row['verify_all_s']):.2f} s"
            )
            print(
                f"  {'':16s} load alternating with/without verification: {min(row['load_verified_s']):.2f} s / "
                f"{min(row['load_unverified_s']):.2f} s (min of {len(row['load_verified_s'])}): "
                f"verification adds {100 * added:+.1f} %"
            )
    for name, row in report.items():
        if name.startswith("export"):
            if "error" in row:
                print(f"  {name}: {row['error'][:300]}")
                continue
            print(
                f"  {name}: peak RSS {row['peak_kib'] / 1024:.0f} MiB, {(row['peak_kib'] - row['base_kib']) / 1024:.0f} "
                f"MiB above the process after imports, {row['seconds']:.2f} s"
            )
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
