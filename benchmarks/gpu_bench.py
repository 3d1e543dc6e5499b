"""GPU benchmark: a GPT of ~1.3B parameters at ZeRO stage 2, stage 3 and stage 3 with CPU offload,
shardwise side by side with FSDP2 and DeepSpeed, in one invocation (issue 37).

Every case is a fresh world-of-one process (``gpu_worker.py``) on GPU 0, run one after the other,
the frameworks of a row in turn. The table gives, per case, the median step time, tokens/s, model
TFLOP/s, MFU against ``--peak-tflops`` (the GPU's dense bf16 datasheet peak; the measured rate of a
large bf16 matrix product is printed beside it), peak GPU memory and peak host RSS; and per row
shardwise's step time over the best peer's (< 1: shardwise faster). ``--largest SIZE ...`` then tries
those sizes with stage 3 + offload (``z3off``: the optimizer; ``z3offp``: parameters too) for each
framework and reports the largest that trained, its step time and memory.

Each framework can get its own import path: ``--shardwise-path`` (default: this checkout's ``src``)
and ``--deepspeed-path`` (a directory holding DeepSpeed 0.19.8, e.g. a ``pip install --target``;
default: whatever the interpreter imports). DeepSpeed's FusedAdam and CPUAdam are built by its JIT
loader on first use (``TORCH_EXTENSIONS_DIR`` keeps them); ``--ds-torch-adam`` makes it use torch's
AdamW instead, for machines where its ops cannot build (the table says so).

    python benchmarks/gpu_bench.py --out gpu-bench.json
    python benchmarks/gpu_bench.py --modes z3off --largest 4b 6.7b --frameworks shardwise deepspeed
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from rank_processes import free_port, last_error_line  # noqa: E402

FRAMEWORKS = ("shardwise", "fsdp2", "deepspeed")
MODE_NAMES = {"z2": "stage 2", "z3": "stage 3", "z3off": "stage 3 + optimizer offload",
              "z3offp": "stage 3 + optimizer and parameter offload"}  # fmt: skip


def matmul_tflops() -> float | None:
    """The measured bf16 rate of an 8192^3 matrix product (median of 10 after 3 warm-ups), or None."""
    code = (
        "import torch,statistics;a=torch.randn(8192,8192,device='cuda',dtype=torch.bfloat16);"
        "b=torch.randn(8192,8192,device='cuda',dtype=torch.bfloat16);t=[]\n"
        "for i in range(13):\n s=torch.cuda.Event(enable_timing=True);e=torch.cuda.Event(enable_timing=True);"
        "s.record();a@b;e.record();torch.cuda.synchronize()\n if i>=3:t.append(s.elapsed_time(e))\n"
        "print(2*8192**3/statistics.median(t)/1e9)"
    )
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        return float(out.stdout.strip().splitlines()[-1])
    except Exception:
        return None


def run_case(args: argparse.Namespace, framework: str, mode: str, size: str) -> dict[str, Any]:
    """One case in a fresh process; its JSON result, or ``{"error": ...}``."""
    cmd = [sys.executable, str(HERE / "gpu_worker.py"), "--framework", framework, "--mode", mode, "--size", size,
           "--seq", str(args.seq), "--micro-batch", str(args.micro_batch), "--warmup", str(args.warmup),
           "--steps", str(args.steps), "--peak-tflops", str(args.peak_tflops), "--device", args.device]  # fmt: skip
    if framework == "deepspeed" and args.ds_torch_adam:
        cmd.append("--torch-adam")
    extra = {"shardwise": args.shardwise_path, "deepspeed": args.deepspeed_path}.get(framework)
    path = os.pathsep.join(p for p in (extra, os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), PYTHONPATH=path)  # fmt: skip
    if framework == "deepspeed":
        env.setdefault("DS_ACCELERATOR", args.device)
    start = time.monotonic()
    code: int | None
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.case_timeout)
        stdout, text, code = proc.stdout, proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as expired:  # its captured output is bytes whatever text= says
        stdout = ""
        text = b"".join(part for part in (expired.stdout, expired.stderr) if isinstance(part, bytes)).decode(
            errors="replace")
        code = None
    wall = time.monotonic() - start
    if args.log_dir:
        Path(args.log_dir, f"{framework}-{mode}-{size}.log").write_text(text)
    result: dict[str, Any] = {"framework": framework, "mode": mode, "size": size, "wall_s": round(wall, 1)}
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if code is None:
        result["error"] = f"timed out after {args.case_timeout} s"
    elif lines:
        result.update(json.loads(lines[-1]))
    else:
        result["error"] = f"exit {code}: {last_error_line(text)}"
    return result


def row_line(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"| {r['mode']} | {r['size']} | {r['framework']} | failed: {r['error'][:160]} |"
    return (
        f"| {r['mode']} | {r['size']} | {r['framework']}{' (torch_adam)' if r.get('torch_adam') else ''} | "
        f"{r['step_s'] * 1e3:.0f} | {r['tokens_per_s']:.0f} | {r['tflops']:.0f} | {100 * r['mfu']:.1f}% | "
        f"{r['peak_gpu_alloc_gib']:.1f} / {r['peak_gpu_reserved_gib']:.1f} | {r['peak_host_rss_gib']:.1f} | "
        f"{r.get('ratio', '')} |"
    )


def add_ratios(results: list[dict[str, Any]]) -> None:
    """shardwise's step time over the best peer's of the same mode and size."""
    for r in results:
        if r["framework"] != "shardwise" or "error" in r:
            continue
        peers = [p["step_s"] for p in results if p["mode"] == r["mode"] and p["size"] == r["size"]
                 and p["framework"] != "shardwise" and "error" not in p]  # fmt: skip
        if peers:
            r["ratio"] = f"{r['step_s'] / min(peers):.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="*", default=["z2", "z3", "z3off"], choices=list(MODE_NAMES))
    parser.add_argument("--frameworks", nargs="+", default=list(FRAMEWORKS), choices=FRAMEWORKS)
    parser.add_argument("--size", default="1.3b")
    parser.add_argument("--largest", nargs="*", default=[], help="sizes to try with --largest-mode")
    parser.add_argument("--largest-mode", default="z3off", choices=["z3off", "z3offp"])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--peak-tflops", type=float, default=989.4, help="dense bf16 peak (H100/H200 SXM: 989.4)")
    parser.add_argument("--case-timeout", type=float, default=240.0)
    parser.add_argument("--shardwise-path", default=str(HERE.parent / "src"))
    parser.add_argument("--deepspeed-path", default="")
    parser.add_argument("--ds-torch-adam", action="store_true")
    parser.add_argument("--log-dir", default="")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cpu: a smoke run of the harness itself (gloo, tiny sizes), no figures")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if args.log_dir:
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)

    measured = matmul_tflops() if args.device == "cuda" else None
    print(f"bf16 8192^3 matmul: {measured and round(measured)} TFLOP/s measured; MFU below is against "
          f"{args.peak_tflops} TFLOP/s", flush=True)  # fmt: skip
    results: list[dict[str, Any]] = []
    for mode in args.modes:
        for framework in args.frameworks:
            r = run_case(args, framework, mode, args.size)
            results.append(r)
            print(row_line(r), f"({r['wall_s']} s)", flush=True)
    for size in args.largest:
        for framework in args.frameworks:
            r = run_case(args, framework, args.largest_mode, size)
            results.append(r)
            print(row_line(r), f"({r['wall_s']} s)", flush=True)
    add_ratios(results)
    print(f"\nseq {args.seq}, micro batch {args.micro_batch}, world size 1, bf16, AdamW, clip 1.0; "
          f"median of {args.steps} steps after {args.warmup}")  # fmt: skip
    print("| mode | size | framework | step ms | tokens/s | TFLOP/s | MFU | GPU GiB alloc / reserved | host GiB | sw / best peer |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(row_line(r))
    if args.out:
        Path(args.out).write_text(json.dumps({"matmul_tflops": measured, "args": vars(args), "results": results},
                                             indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
