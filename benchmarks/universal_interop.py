"""Universal checkpoints between DeepSpeed 0.19.8 and shardwise, both directions (``make test-interop``).

For every cell of {ZeRO stage 0-3} x {fp32, bf16} x {AdamW} x {save ranks -> resume ranks}:

* **DeepSpeed writes, shardwise resumes**: DeepSpeed trains ``--steps`` steps and saves; its own
  ``ds_to_universal`` converts the checkpoint (at stage 0, which it refuses for want of ZeRO files,
  ``shardwise checkpoint to-universal`` converts DeepSpeed's native file); shardwise resumes with
  ``"checkpoint": {"load_universal": true}``; its next losses are compared with DeepSpeed's own
  continued run.
* **shardwise writes, DeepSpeed resumes**: shardwise trains and saves;
  ``shardwise checkpoint to-universal`` converts; DeepSpeed resumes with ``load_universal``; its next
  losses are compared with shardwise's own continued run.

Two losses are compared per cell: the first step after the resume (it checks the weights) and the
second (it checks the optimizer state the first update used: exp_avg, exp_avg_sq, step). fp32 cells
pass within ``1e-6`` (both sides run the same fp32 operations on the same values, so only the
reduction order of a changed world size can differ); bf16 cells within ``1e-3`` relative (measured
up to 1.1e-4: an fp32 master one ulp apart, from another reduction order or Adam kernel, can round
to the neighbouring bf16 value, which moves that weight by 2^-8 relative in the next forward); and
shardwise's ZeRO-3 bf16 forward rounds differently from its stages 0-2 on the very same weights
(measured 7.6e-4 with no DeepSpeed involved: one universal checkpoint resumed at stage 2 and at
stage 3), which the DeepSpeed-stage-3 -> shardwise-stage-3 bf16 cell shows.

DeepSpeed runs from a side interpreter (``--ds-python``, default ``.venv-ds/bin/python``, made by
``make bench-setup``) with ``DS_ACCELERATOR=cpu``; shardwise never imports it. A cell that fails on
DeepSpeed's side for a reason DeepSpeed itself has (it cannot convert or load that layout) is
reported as ``ds-limit`` with the error line, not as a shardwise failure; a cell shardwise does not
cover is listed as ``gap`` with the reason (``GAPS``); the exit status is 1 when any other cell fails.

Example:
    python benchmarks/universal_interop.py --ds-python /work/venv-ds/bin/python --stages 2 --dtypes fp32
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("universal_interop_worker.py")
DEFAULT_DS_PYTHON = REPO / ".venv-ds" / "bin" / "python"
SW_PYTHON = sys.executable
# Cells not run, and why (listed in the output, never counted as passing).
GAPS = {
    (
        "deepspeed",
        0,
        "bf16",
    ): "DeepSpeed's stage-0 bf16 checkpoint holds its BF16_Optimizer wrapper's flat state "
    "(no per-parameter map in the model-states file), which shardwise does not import; ds_to_universal refuses stage 0",
}
TOLERANCE = {"fp32": ("abs", 1e-6), "bf16": ("rel", 1e-3)}


def free_port() -> int:
    """An unused TCP port on localhost."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class StepFailed(RuntimeError):
    """A launched step failed; ``side`` says whose code failed and ``line`` the last error line."""

    def __init__(self, side: str, what: str, line: str) -> None:
        super().__init__(f"{side} {what}: {line}")
        self.side, self.what, self.line = side, what, line


def _last_error(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "Error" in ln or "Exception" in ln or ln.startswith("error:"):
            return ln[:300]
    return (lines[-1] if lines else "no output")[:300]


def run_ranks(python: str, side: str, world: int, args: list[str], *, timeout: float) -> None:
    """``world`` ranks of the worker; raises :class:`StepFailed` if any fails."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            DS_ACCELERATOR="cpu",
            PYTHONUNBUFFERED="1",
        )
        cmd = [python, str(WORKER), "--side", side, *args]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outputs, failed = [], False
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            out += b"\n error: timed out"
        outputs.append(out.decode(errors="replace"))
        failed |= proc.returncode != 0
    if failed:
        raise StepFailed(side, args[args.index("--action") + 1], _last_error("\n".join(outputs)))


def run_tool(cmd: list[str], side: str, what: str, *, timeout: float) -> None:
    """A conversion command; raises :class:`StepFailed` with its last error line."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise StepFailed(side, what, _last_error(proc.stdout + proc.stderr))


@dataclass
class Cell:
    """One matrix cell's outcome."""

    writer: str
    stage: int
    dtype: str
    save_world: int
    load_world: int
    converter: str = "ds_to_universal"
    status: str = "fail"
    diffs: list[float] = field(default_factory=list)
    detail: str = ""
    seconds: float = 0.0


def run_cell(cell: Cell, ds_python: str, steps: int, timeout: float) -> None:
    """Write, convert, resume and compare one cell (fills ``cell`` in place)."""
    pythons = {"deepspeed": ds_python, "shardwise": SW_PYTHON}
    reader = "shardwise" if cell.writer == "deepspeed" else "deepspeed"
    common = ["--stage", str(cell.stage), "--dtype", cell.dtype, "--steps", str(steps)]
    start = time.perf_counter()
    gap = GAPS.get((cell.writer, cell.stage, cell.dtype))
    if gap is not None:
        cell.status, cell.detail = "gap", gap
        return
    with tempfile.TemporaryDirectory(prefix="uc_interop_") as tmp:
        native, universal = Path(tmp) / "native", Path(tmp) / "universal"
        tag = f"global_step{steps}"
        try:
            ref_out = Path(tmp) / "writer.json"
            run_ranks(
                pythons[cell.writer],
                cell.writer,
                cell.save_world,
                [*common, "--action", "save", "--ckpt", str(native), "--out", str(ref_out)],
                timeout=timeout,
            )
            if cell.writer == "deepspeed" and cell.stage > 0:
                run_tool(
                    [
                        ds_python,
                        "-m",
                        "deepspeed.checkpoint.ds_to_universal",
                        "--input_folder",
                        str(native / tag),
                        "--output_folder",
                        str(universal / tag),
                        "--inject_missing_state",
                    ],
                    "deepspeed",
                    "ds_to_universal",
                    timeout=timeout,
                )
            else:  # also DeepSpeed's stage 0, which ds_to_universal refuses (it saves no ZeRO files)
                cell.converter = "shardwise to-universal"
                run_tool(
                    [
                        str(Path(SW_PYTHON).with_name("shardwise")),
                        "checkpoint",
                        "to-universal",
                        str(native),
                        str(universal),
                    ],
                    "shardwise",
                    "to-universal",
                    timeout=timeout,
                )
            out = Path(tmp) / "reader.json"
            run_ranks(
                pythons[reader],
                reader,
                cell.load_world,
                [*common, "--action", "resume", "--ckpt", str(universal), "--out", str(out)],
                timeout=timeout,
            )
        except (StepFailed, subprocess.TimeoutExpired) as error:
            cell.status = (
                "ds-limit" if isinstance(error, StepFailed) and error.side == "deepspeed" else "fail"
            )
            cell.detail = str(error)
            cell.seconds = time.perf_counter() - start
            return
        want = json.loads(ref_out.read_text())["losses"]
        got = json.loads(out.read_text())["losses"]
    kind, bound = TOLERANCE[cell.dtype]
    cell.diffs = [abs(a - b) / (abs(a) if kind == "rel" else 1.0) for a, b in zip(want, got)]
    ok = len(got) == len(want) and all(math.isfinite(d) and d <= bound for d in cell.diffs)
    cell.status = "pass" if ok else "fail"
    cell.detail = f"writer {[f'{v:.8f}' for v in want]} reader {[f'{v:.8f}' for v in got]}"
    cell.seconds = time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ds-python", default=os.environ.get("DS_PYTHON") or str(DEFAULT_DS_PYTHON))
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--worlds", nargs="+", default=["1:1", "2:2", "2:1"], help="save:resume rank counts")
    parser.add_argument("--writers", nargs="+", default=["deepspeed", "shardwise"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--json", default=None, help="also write the cells as JSON here")
    args = parser.parse_args()
    if not Path(args.ds_python).exists():
        print(
            f"error: no DeepSpeed interpreter at {args.ds_python}; run `make bench-setup` or pass DS_PYTHON="
        )
        return 2
    cells = []
    for writer, stage, dtype, worlds in itertools.product(
        args.writers, args.stages, args.dtypes, args.worlds
    ):
        save_world, load_world = (int(w) for w in worlds.split(":"))
        cell = Cell(writer, stage, dtype, save_world, load_world)
        run_cell(cell, args.ds_python, args.steps, args.timeout)
        cells.append(cell)
        diffs = ", ".join(f"{d:.1e}" for d in cell.diffs) or "-"
        print(
            f"{writer:>9} -> {'shardwise' if writer == 'deepspeed' else 'deepspeed':<9} stage {stage} {dtype} "
            f"{save_world}->{load_world} ranks via {cell.converter}: {cell.status:<8} diffs [{diffs}] "
            f"({cell.seconds:.0f}s) {cell.detail}",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps([c.__dict__ for c in cells], indent=1))
    counts = {s: sum(c.status == s for c in cells) for s in ("pass", "ds-limit", "gap", "fail")}
    print(
        f"{counts['pass']} pass, {counts['ds-limit']} DeepSpeed limits, {counts['gap']} not covered (see GAPS), "
        f"{counts['fail']} fail"
    )
    return 1 if counts["fail"] else 0


if __name__ == "__main__":
    sys.exit(main())
