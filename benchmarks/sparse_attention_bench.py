"""SparseSelfAttention (fixed, bigbird) vs dense ``scaled_dot_product_attention`` on CPU.

One invocation runs every case side by side: for each sequence length, the forward+backward
time (median of ``--repeats`` after a warm-up; wall and CPU time of the process: on one thread
the CPU time is the compute time and holds steady on a loaded machine, so the ratios use it)
and the peak memory of one step, and prints the ratios against dense. Each case runs twice, in
fresh subprocesses. Memory: glibc is told to mmap blocks over 64 KiB and to return freed memory,
so resident memory follows the live tensors; after a warm-up step the peak (``VmHWM``) is reset
through ``/proc/self/clear_refs`` and the number reported is the peak of one step minus the
resident memory just before it (inputs allocated, layout and plan built), i.e. what the
attention itself needs (Linux). Time: under glibc's default allocator, as in a training run
(freed blocks are reused); under the mmap setting every temporary over 64 KiB would get fresh
zeroed pages, which costs a chunked computation with many mid-sized temporaries about its
compute time again.

    python benchmarks/sparse_attention_bench.py                       # 512..8192, about 5 minutes
    python benchmarks/sparse_attention_bench.py --lengths 512 2048 --threads 2
    python benchmarks/sparse_attention_bench.py --loss weighted     # a dense output gradient

The loss is ``out.sum()`` by default: its output gradient is a broadcast view that costs no
memory unless the attention copies it (dense SDPA's backward does); ``--loss weighted`` uses
``(out * w).sum()``, whose output gradient is a dense tensor as a real loss gives, for both peers.

Peers: ``dense`` is ``scaled_dot_product_attention`` (a fused flash-style CPU kernel: its memory
is O(L)); ``math`` is dense attention written out (softmax of the materialised ``L x L`` scores),
the memory reference for a non-fused implementation. The layouts are DeepSpeed's defaults at block 16: fixed (4 local blocks, 1 global) and bigbird
(1 random, 3 sliding, 1 global); "density" is the layout's share of the ``L x L`` blocks.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

# glibc: large blocks always mmap'd and freed memory returned, so resident memory tracks live tensors
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}

CASE = r"""
import json, statistics, sys, time
import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa
from shardwise.ops.sparse_attention import BigBirdSparsityConfig, FixedSparsityConfig, SparseSelfAttention
kind, loss, phase = sys.argv[1:4]
length, heads, dim, block, repeats, threads = map(int, sys.argv[4:])
torch.set_num_threads(threads)
torch.manual_seed(0)
q, k, v = (torch.randn(1, heads, length, dim, requires_grad=True) for _ in range(3))
density = 1.0
if kind == "dense":
    attend = sdpa
elif kind == "math":  # dense attention that materialises the L x L scores (no fused kernel)
    def attend(q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5, dim=-1) @ v
else:
    cfg = (FixedSparsityConfig(heads, block=block) if kind == "fixed"
           else BigBirdSparsityConfig(heads, block=block, num_random_blocks=1))
    module = SparseSelfAttention(cfg, max_seq_length=length)
    density = module.plan(length, q.device).nonzero_blocks / (length // block) ** 2
    attend = module
weight = torch.randn(1, heads, length, dim) if loss == "weighted" else None
def step():
    out = attend(q, k, v)
    (out.sum() if weight is None else (out * weight).sum()).backward()
    q.grad = k.grad = v.grad = None
def status_kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
step()  # warm-up
if phase == "memory":
    before = status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the peak resident size (VmHWM) to the current one
    step()
    print(json.dumps({"peak_mib": max(status_kib("VmHWM") - before, 0) / 1024, "density": density}))
else:
    times, cpu_times = [], []
    for _ in range(repeats):
        t, c = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - t)
        cpu_times.append(time.process_time() - c)
    print(json.dumps({"ms": 1000 * statistics.median(times), "cpu_ms": 1000 * statistics.median(cpu_times)}))
"""


def run_phase(kind: str, length: int, phase: str, args: argparse.Namespace) -> dict[str, float] | str:
    """One phase of one case in a fresh interpreter; its JSON line, or why it failed."""
    argv = [kind, args.loss, phase, length, args.heads, args.head_dim, args.block, args.repeats, args.threads]
    cmd = [sys.executable, "-c", CASE, *map(str, argv)]
    env = {**os.environ, **MALLOC_ENV} if phase == "memory" else None
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, check=False, env=env)
    except subprocess.TimeoutExpired:
        return f"timed out after {args.timeout}s"
    if done.returncode != 0:
        return f"failed: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_case(kind: str, length: int, args: argparse.Namespace) -> dict[str, float] | str:
    """A case's time (glibc's default allocator) and peak memory (the mmap setting), in two interpreters."""
    memory = run_phase(kind, length, "memory", args)
    timing = run_phase(kind, length, "time", args)
    for result in (memory, timing):
        if isinstance(result, str):
            return result
    assert isinstance(memory, dict) and isinstance(timing, dict)
    return {**memory, **timing}


def main() -> None:
    """Run the grid and print one table."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--timeout", type=int, default=600)
    parser.add_argument(
        "--loss",
        choices=("sum", "weighted"),
        default="sum",
        help="sum: out.sum(), whose output gradient is a broadcast view (no memory) that a kernel may "
        "copy; weighted: (out * w).sum(), a dense output gradient as a real loss gives",
    )
    args = parser.parse_args()
    print(
        f"batch 1, {args.heads} heads, head_dim {args.head_dim}, block {args.block}, fp32, "
        f"{args.threads} thread(s); forward+backward of the {args.loss} loss, median of {args.repeats}"
    )
    header = (
        f"{'seq':>6} {'kind':>7} {'density':>8} {'wall ms':>9} {'cpu ms':>9} {'x dense':>8} "
        f"{'peak MiB':>9} {'x dense':>8}"
    )
    print(header)
    print("-" * len(header))
    started = time.perf_counter()
    for length in args.lengths:
        dense = run_case("dense", length, args)
        for kind in ("dense", "math", "fixed", "bigbird"):
            row = dense if kind == "dense" else run_case(kind, length, args)
            if isinstance(row, str):
                print(f"{length:>6} {kind:>7} {row}")
                continue
            ratio_t = ratio_m = "-"
            if kind != "dense" and not isinstance(dense, str):
                ratio_t = f"{row['cpu_ms'] / dense['cpu_ms']:.2f}"
                ratio_m = f"{row['peak_mib'] / dense['peak_mib']:.2f}" if dense["peak_mib"] > 0 else "-"
            print(
                f"{length:>6} {kind:>7} {row['density']:>8.3f} {row['ms']:>9.1f} "
                f"{row['cpu_ms']:>9.1f} {ratio_t:>8} "
                f"{row['peak_mib']:>9.1f} {ratio_m:>8}"
            )
    print(f"({time.perf_counter() - started:.0f} s; ratios < 1 mean sparse is faster / smaller)")


if __name__ == "__main__":
    main()
