"""Larger than RAM: stage 3 with parameters and optimizer state on NVMe, shardwise vs DeepSpeed.

Trains the project's GPT (``src/shardwise/testing/models.py``, sized by ``--params``) for
``--steps`` steps of micro batch 1 x ``--seq`` tokens on ``--ranks`` CPU gloo ranks, ZeRO stage 3
with ``offload_param`` and ``offload_optimizer`` both ``{device: nvme}``, AdamW, fp32, the model
built under ``zero.Init(remote_device="nvme")`` (``--no-zero-init``: built whole first). Every rank
trains on one fixed random micro batch, so the loss falls step after step when training works.

Before the runs it measures the disk's sequential limit on ``--nvme-path``'s filesystem
(``disk_limit.py``: fio, else dd; direct and buffered). Per framework it reports per step: wall
time (slower rank), loss (mean of ranks), bytes read and written (``/proc/<pid>/io``
``read_bytes``/``write_bytes``, all ranks summed; ``rchar``/``wchar`` as the syscall-level
figure), the disk bandwidth reached (bytes / step time) against the measured limit, and the peak
``RssAnon``/``VmRSS`` (50 ms sampler) and ``VmHWM`` per phase, summed over ranks, against the
machine's RAM. DeepSpeed runs the same model and config from ``.venv-ds`` (``DS_ACCELERATOR=cpu``)
when its ``async_io`` op builds; otherwise its row says why.

A benchmark, not a test: the 4.76B run needs ~57-76 GB of disk (DeepSpeed ~100 GB) and hours; a
framework whose swap files would not fit in the free space is skipped, its row says so. Example (see README)::

    .venv/bin/python benchmarks/nvme_offload_bench.py --params 4.8e9 --ranks 1 --steps 3 \\
        --nvme-path /mnt/nvme/bench --out results.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
import disk_limit  # noqa: E402  (this script's directory)
from nvme_offload_report import GB, print_report, summarize  # noqa: E402
from rank_processes import free_port, last_error_line, wait_ranks  # noqa: E402

# Swap-file bytes per parameter, with a margin over what was measured at 0.1-0.2B parameters (12 and
# 21): shardwise keeps the fp32 parameters and AdamW's moments in its files (the model state's 16
# B/param as the bound), DeepSpeed also the fp32 master copy and the gradients.
DISK_BYTES_PER_PARAM = {"shardwise": 16, "deepspeed": 22}
WORKER = HERE / "nvme_offload_worker.py"
MODELS = REPO / "src" / "shardwise" / "testing" / "models.py"

_AIO_PROBE = (
    "from deepspeed.ops.op_builder import AsyncIOBuilder as B\n"
    "b = B()\n"
    "assert b.is_compatible(True), 'AsyncIOBuilder.is_compatible() is False'\n"
    "b.load()\n"
    "import deepspeed; print('ok', deepspeed.__version__)\n"
)


def model_shape(params: float, width: int | None, vocab: int, seq: int) -> dict[str, Any]:
    """A ``GPTConfig`` of about ``params`` parameters: layers = (params - embeddings) / block size."""
    d = width or (1024 if params <= 5e8 else 2048 if params <= 2e9 else 4096)
    per_layer = 12 * d * d + 13 * d
    fixed = vocab * d + seq * d + 2 * d
    layers = max(1, round((params - fixed) / per_layer))
    return {
        "vocab_size": vocab,
        "block_size": seq,
        "n_layer": layers,
        "n_head": max(1, d // 128),
        "n_embd": d,
    }


def param_count(shape: dict[str, Any]) -> int:
    """Parameters of a TinyGPT of ``shape`` (the tied LM head counted once)."""
    d, v, t, n = shape["n_embd"], shape["vocab_size"], shape["block_size"], shape["n_layer"]
    return int(v * d + t * d + 2 * d + n * (12 * d * d + 13 * d))


def ds_config(args: argparse.Namespace, shape: dict[str, Any], nvme: Path) -> dict[str, Any]:
    """The one DeepSpeed-format config both frameworks get."""
    d, n = shape["n_embd"], param_count(shape)
    largest = shape["vocab_size"] * d  # the embedding, the largest tensor
    part = -(-largest // args.ranks)
    buffer_elems = args.buffer_size or -(-part // (1 << 20)) * (1 << 20)  # >= the largest partition
    sub_group = args.sub_group_size or int(min(1e8, max(1 << 20, n // args.ranks // 8)))
    offload = {"device": "nvme", "nvme_path": str(nvme), "pin_memory": False}
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 1 << 30,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": args.lr,
                "betas": [0.9, 0.999],
                "eps": 1e-8,
                "weight_decay": 0.0,
                "torch_adam": True,
            },
        },
        "zero_optimization": {
            "stage": 3,
            "offload_param": {
                **offload,
                "buffer_count": args.buffer_count,
                "buffer_size": buffer_elems,
                "max_in_cpu": 0,
            },
            "offload_optimizer": {
                **offload,
                "buffer_count": 4,
                "pipeline_read": False,
                "pipeline_write": False,
            },
            "sub_group_size": sub_group,
            # the smallest working set: nothing kept gathered, prefetched or persistent
            "stage3_max_live_parameters": 0,
            "stage3_prefetch_bucket_size": 0,
            "stage3_param_persistence_threshold": 0,
            # release every gathered parameter after its module ran (DeepSpeed's default, 1e9, keeps
            # them while the live budget allows, and then runs out of offload_param buffers)
            "stage3_max_reuse_distance": 0,
            "reduce_bucket_size": largest,  # DeepSpeed's default 5e8 is a 2 GB fp32 bucket per rank
            "contiguous_gradients": True,
            "overlap_comm": False,
        },
        "aio": {
            "block_size": 1 << 20,
            "queue_depth": 8,
            "thread_count": 1,
            "single_submit": False,
            "overlap_events": True,
        },
        "zero_force_ds_cpu_optimizer": False,
    }


def launch(spec: dict[str, Any], python: str, ranks: int, env_extra: dict[str, str], timeout: float) -> Any:
    """Run the worker on ``ranks`` processes; the ranks' results, or an error string."""
    with tempfile.TemporaryDirectory(prefix="nvme_bench_") as tmp:
        port, procs, logs = free_port(), [], []
        threads = str(max(1, (os.cpu_count() or 1) // ranks))
        for rank in range(ranks):
            env = dict(os.environ, **env_extra)
            env.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(ranks),
                LOCAL_WORLD_SIZE=str(ranks),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                OMP_NUM_THREADS=threads,
                MKL_NUM_THREADS=threads,
                PYTHONUNBUFFERED="1",
            )
            rank_spec = dict(spec, out=str(Path(tmp) / f"rank{rank}.json"), threads=int(threads))
            log = open(Path(tmp) / f"rank{rank}.log", "wb")  # noqa: SIM115 - closed below
            logs.append(log)
            procs.append(
                subprocess.Popen(
                    [python, str(WORKER), json.dumps(rank_spec)],
                    env=env,
                    cwd=str(REPO),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
        timed_out = wait_ranks(procs, time.monotonic() + timeout, grace=5.0, poll=0.2)
        for log in logs:
            log.close()
        results, errors = [], []
        for rank, p in enumerate(procs):
            out = Path(tmp) / f"rank{rank}.json"
            if out.exists():
                results.append(json.loads(out.read_text()))
                continue
            err = out.with_suffix(".error")
            text = err.read_text() if err.exists() else (Path(tmp) / f"rank{rank}.log").read_text()
            errors.append(f"rank {rank} (exit {p.returncode}): {last_error_line(text)}")
        if errors or len(results) != ranks:
            return ("timed out: " if timed_out else "") + ("; ".join(errors) or "no result")
        return results


def device_stat(path: Path) -> str | None:
    """``/sys/dev/block/M:m/stat`` of the block device holding ``path``, or None (no such device)."""
    st = path.stat()
    stat = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/stat")
    return str(stat) if stat.exists() else None


def _ram_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemTotal in /proc/meminfo")


def check_deepspeed(python: str) -> str | None:
    """None when DeepSpeed imports and its async_io op builds, else why not."""
    if not Path(python).exists():
        return f"not available: {python} does not exist (make bench-setup)"
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    try:
        done = subprocess.run(
            [python, "-c", _AIO_PROBE], capture_output=True, text=True, env=env, timeout=900
        )
    except subprocess.TimeoutExpired:
        return "not available: building DeepSpeed's async_io op took over 15 minutes"
    if done.returncode != 0:
        warn = [ln.strip() for ln in done.stdout.splitlines() + done.stderr.splitlines() if "async_io" in ln]
        return (
            f"not available: DeepSpeed's async_io op does not build here: {last_error_line(done.stderr)} "
            + " | ".join(warn[:3])
        )
    return None


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--params",
        type=float,
        default=4.8e9,
        help="target parameter count (default 4.8e9: 16 B/param >= 3x 24 GiB)",
    )
    p.add_argument("--width", type=int, default=None, help="n_embd (default: 1024/2048/4096 by size)")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=32, help="tokens per micro batch (micro batch 1)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--ranks", type=int, choices=(1, 2), default=1)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--nvme-path", type=Path, default=Path(tempfile.gettempdir()) / "shardwise-nvme-bench")
    p.add_argument(
        "--frameworks", nargs="+", choices=("shardwise", "deepspeed"), default=["shardwise", "deepspeed"]
    )
    p.add_argument(
        "--no-zero-init",
        dest="zero_init",
        action="store_false",
        help="build the model whole, then initialize (default: under zero.Init(remote_device='nvme'))",
    )
    p.add_argument(
        "--sub-group-size", type=int, default=None, help="elements (default min(1e8, params/ranks/8))"
    )
    p.add_argument(
        "--buffer-size",
        type=int,
        default=None,
        help="offload_param.buffer_size (default: the largest partitioned tensor, rounded up to 2^20)",
    )
    p.add_argument("--buffer-count", type=int, default=5, help="offload_param.buffer_count")
    p.add_argument(
        "--disk-test-gib", type=float, default=4.0, help="size of the disk test file (0: skip the test)"
    )
    p.add_argument(
        "--malloc-mmap-threshold",
        type=int,
        default=1 << 20,
        help="glibc MALLOC_MMAP_THRESHOLD_ for the ranks (default 1 MiB; 0: glibc's dynamic default)",
    )
    p.add_argument("--timeout", type=float, default=6 * 3600, help="seconds per framework run")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--ds-python", default=str(REPO / ".venv-ds" / "bin" / "python"))
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    command = " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv])
    ram = _ram_bytes()
    shape = model_shape(args.params, args.width, args.vocab, args.seq)
    n = param_count(shape)
    base = args.nvme_path
    base.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(base).free
    need = {name: DISK_BYTES_PER_PARAM[name] * n for name in args.frameworks}
    print(f"command: {command}")
    print(
        f"model: {shape} = {n / 1e9:.3f}B parameters; {args.ranks} rank(s) x {max(1, (os.cpu_count() or 1) // args.ranks)}"
        f" threads; RAM {ram / 2**30:.1f} GiB; {base}: {free / GB:.1f} GB free; swap files need about "
        + ", ".join(f"{need[name] / GB:.1f} GB ({name})" for name in args.frameworks)
    )
    limit = disk_limit.measure(base, int(args.disk_test_gib * 2**30)) if args.disk_test_gib > 0 else {}
    rows: dict[str, Any] = {}
    configs: dict[str, Any] = {}
    for name in args.frameworks:
        run_dir = base / f"{name}-{os.getpid()}"
        cfg = ds_config(args, shape, run_dir)
        configs[name] = cfg
        python, env = (
            (args.python, {}) if name == "shardwise" else (args.ds_python, {"DS_ACCELERATOR": "cpu"})
        )
        if need[name] > shutil.disk_usage(base).free:
            rows[name] = (
                f"skipped: its swap files need about {need[name] / GB:.1f} GB under {base} "
                f"({DISK_BYTES_PER_PARAM[name]} B/param), {shutil.disk_usage(base).free / GB:.1f} GB free"
            )
            continue
        if name == "deepspeed":
            why = check_deepspeed(python)
            if why is not None:
                rows[name] = why
                continue
        spec = {
            "framework": name,
            "models_path": str(MODELS),
            "model": shape,
            "seq": args.seq,
            "steps": args.steps,
            "zero_init": args.zero_init,
            "config": cfg,
            "device_stat": device_stat(base),
        }
        print(f"running {name} ...", flush=True)
        if args.malloc_mmap_threshold > 0:
            # glibc: blocks from this size up straight from mmap, so freed memory leaves the process (the
            # default threshold grows as blocks are freed and keeps them in the heap): the peaks measure
            # what the run holds, not the heap's history. The same for both frameworks.
            env["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)
        try:
            out = launch(spec, python, args.ranks, env, args.timeout)
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)
        rows[name] = f"failed: {out}" if isinstance(out, str) else summarize(out, limit, ram)
    with contextlib.suppress(OSError):
        base.rmdir()  # only when empty: the runs' directories are gone
    print_report(rows, limit, ram)
    print(f"\ncommand: {command}")
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "command": command,
                    "model": shape,
                    "params": n,
                    "ram_bytes": ram,
                    "ranks": args.ranks,
                    "zero_init": args.zero_init,
                    "disk_limit": limit,
                    "configs": configs,
                    "results": rows,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
