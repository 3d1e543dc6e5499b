"""Universal checkpoints between DeepSpeed 0.19.8 and shardwise, both directions (``make test-interop``).

For every cell of {ZeRO stage 0-3} x {fp32, bf16} x {AdamW, Muon} x {save ranks -> resume ranks}
(default 1:1 2:2 2:1 3:3 2:3 3:2 3:1):

* **DeepSpeed writes, shardwise resumes**: DeepSpeed trains ``--steps`` steps and saves; its own
  ``ds_to_universal`` converts the checkpoint; where that fails (stage 0: no ZeRO files; Muon: it
  reads only Adam's ``exp_avg``/``exp_avg_sq``, DeepSpeed issue 8608) the failure is named in the
  cell's converter column and ``shardwise checkpoint to-universal`` converts DeepSpeed's native
  checkpoint instead; shardwise resumes with ``"checkpoint": {"load_universal": true}``; its next
  losses are compared with DeepSpeed's own continued run.
* **shardwise writes, DeepSpeed resumes**: shardwise trains and saves;
  ``shardwise checkpoint to-universal`` converts; DeepSpeed resumes with ``load_universal``; its next
  losses are compared with shardwise's own continued run. Stage 0 is the exception: DeepSpeed 0.19.8
  cannot resume a universal checkpoint at stage 0, so ``shardwise checkpoint to-deepspeed`` writes
  DeepSpeed's native stage-0 layout and DeepSpeed loads it without ``load_universal``.

Two losses are compared per cell: the first step after the resume (it checks the weights) and the
second (it checks the optimizer state the first update used: exp_avg, exp_avg_sq, step). fp32 cells
pass within ``1e-6`` (both sides run the same fp32 operations on the same values, so only the
reduction order of a changed world size can differ); bf16 cells within ``1e-3`` relative (an fp32
master one ulp apart, from another reduction order or Adam kernel, can round to the neighbouring
bf16 value, which moves that weight by 2^-8 relative in the next forward). shardwise's ZeRO-3
bf16 forward is stage 2's bit for bit on the same weights (FSDP2 casts no forward inputs).

Muon cells judge the first loss only (``UPDATE_DIFFERS``); the second is printed. The two Muon
updates are not the same computation: both run the standard Newton-Schulz iteration in bf16, but
torch's (shardwise's) fuses each step into ``addmm`` where DeepSpeed's multiplies and adds
separately, so the bf16 roundings differ (measured 1.6e-4 on the second loss at stage 0), and
DeepSpeed's own ZeRO-1/2/3 Muon does not train like its stage 0 (5e-3 apart after 3 steps on this
model), so no other run can stand in for DeepSpeed's continued one.

One launch per side and world size runs all its cells (``universal_interop_worker.py``); a cell
that fails ends its launch and the cells after it run in a new one.

DeepSpeed runs from a side interpreter (``--ds-python``, default ``.venv-ds/bin/python``, made by
``make bench-setup``) with ``DS_ACCELERATOR=cpu``; shardwise never imports it. A cell that fails on
DeepSpeed's side (it cannot train, convert or load that layout) is reported as ``ds-limit`` with
DeepSpeed's error line and where it was raised, not as a shardwise failure; a cell shardwise does
not cover is listed as ``gap`` with the reason (``GAPS``); the exit status is 1 when any other cell
fails.

Example:
    python benchmarks/universal_interop.py --ds-python /work/venv-ds/bin/python --stages 2 --dtypes fp32
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shutil
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
GAPS: dict[tuple[str, int, str], str] = {}
# Optimizers whose update rule itself differs between DeepSpeed and shardwise: only the first loss
# after the resume (the weights) is judged; the second is printed, not judged (see the docstring).
UPDATE_DIFFERS = {"Muon"}
TOLERANCE = {"fp32": ("abs", 1e-6), "bf16": ("rel", 1e-3)}


def free_port() -> int:
    """An unused TCP port on localhost."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def launch(python: str, side: str, world: int, args: list[str], *, timeout: float) -> str:
    """``world`` ranks of the worker; returns their joint output's last error line ('' if all exited 0)."""
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
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            out, _ = proc.communicate()
            out += b"\n error: timed out"
        outputs.append(out.decode(errors="replace"))
        failed |= proc.returncode != 0
    return _last_error("\n".join(outputs)) if failed else ""


def _last_error(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "Error" in ln or "Exception" in ln or ln.startswith("error:"):
            return ln[:300]
    return (lines[-1] if lines else "no output")[:300]


def run_batch(
    python: str, side: str, world: int, action: str, cells: list[str], root: Path, steps: int, timeout: float
) -> dict[str, dict]:
    """Run ``cells`` in as few launches as it takes: a launch stops at a failing cell, the rest relaunch.

    Returns ``cell -> record``: rank 0's record for a cell that finished on every rank, else
    ``{"error": ...}`` (the failing rank's own error line, or the launch's last error line).
    """
    records: dict[str, dict] = {}
    todo = list(cells)
    attempt = 0
    while todo:
        attempt += 1
        results = root / f"results-{side}-{action}-w{world}-{attempt}"
        output = launch(
            python,
            side,
            world,
            [
                "--action",
                action,
                "--cells",
                *todo,
                "--root",
                str(root),
                "--results",
                str(results),
                "--steps",
                str(steps),
            ],
            timeout=timeout * len(todo),
        )
        per_rank = []
        for rank in range(world):
            path = Path(f"{results}.rank{rank}")
            lines = path.read_text().splitlines() if path.exists() else []
            per_rank.append({rec["cell"]: rec for rec in map(json.loads, lines)})
        done = [c for c in todo if all(c in recs and "error" not in recs[c] for recs in per_rank)]
        for cell in done:
            records[cell] = per_rank[0][cell]
        rest = [c for c in todo if c not in done]
        if not rest:
            break
        culprit = rest[0]
        errors = [recs[culprit]["error"] for recs in per_rank if "error" in recs.get(culprit, {})]
        records[culprit] = {"error": errors[0] if errors else (output or "the launch ended without a record")}
        todo = rest[1:]
    return records


@dataclass
class Cell:
    """One matrix cell's outcome."""

    writer: str
    stage: int
    dtype: str
    optimizer: str
    save_world: int
    load_world: int
    converter: str = "ds_to_universal"
    status: str = "fail"
    diffs: list[float] = field(default_factory=list)
    detail: str = ""

    @property
    def key(self) -> str:
        """The worker's name for the cell."""
        return f"{self.stage}:{self.dtype}:{self.optimizer}"


def shardwise_convert(root: Path, key: str, steps: int, timeout: float) -> str:
    """``shardwise checkpoint to-universal`` on a DeepSpeed-written cell; its error line or ''."""
    folder = root / key.replace(":", "-")
    shutil.rmtree(folder / "universal", ignore_errors=True)
    cmd = [
        str(Path(SW_PYTHON).with_name("shardwise")),
        "checkpoint",
        "to-universal",
        str(folder / "native"),
        str(folder / "universal"),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    return "" if proc.returncode == 0 else _last_error(proc.stdout + proc.stderr)


def judge(cell: Cell, want: list[float], got: list[float]) -> None:
    """Compare the reader's losses with the writer's continued run (fills ``cell``)."""
    kind, bound = TOLERANCE[cell.dtype]
    cell.diffs = [abs(a - b) / (abs(a) if kind == "rel" else 1.0) for a, b in zip(want, got)]
    judged = cell.diffs[:1] if cell.optimizer in UPDATE_DIFFERS else cell.diffs
    ok = len(got) == len(want) and all(math.isfinite(d) and d <= bound for d in judged)
    cell.status = "pass" if ok else "fail"
    cell.detail = f"writer {[f'{v:.8f}' for v in want]} reader {[f'{v:.8f}' for v in got]}"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ds-python", default=os.environ.get("DS_PYTHON") or str(DEFAULT_DS_PYTHON))
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--optimizers", nargs="+", default=["AdamW", "Muon"], choices=["AdamW", "Muon"])
    parser.add_argument(
        "--worlds",
        nargs="+",
        default=["1:1", "2:2", "2:1", "3:3", "2:3", "3:2", "3:1"],
        help="save:resume rank counts (one save serves every resume of the same save count)",
    )
    parser.add_argument("--writers", nargs="+", default=["deepspeed", "shardwise"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=120, help="seconds per cell of a launch")
    parser.add_argument("--json", default=None, help="also write the cells as JSON here")
    args = parser.parse_args()
    if not Path(args.ds_python).exists():
        print(
            f"error: no DeepSpeed interpreter at {args.ds_python}; run `make bench-setup` or pass DS_PYTHON="
        )
        return 2
    worlds = [tuple(int(w) for w in pair.split(":")) for pair in args.worlds]
    save_worlds = list(dict.fromkeys(save for save, _ in worlds))
    pythons = {"deepspeed": args.ds_python, "shardwise": SW_PYTHON}
    cells: list[Cell] = []
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="uc_interop_") as tmp_name:
        for writer in args.writers:
            reader = "shardwise" if writer == "deepspeed" else "deepspeed"
            for save_world in save_worlds:
                root = Path(tmp_name) / f"{writer}-w{save_world}"
                root.mkdir()
                group = [
                    Cell(writer, stage, dtype, optimizer, save_world, load)
                    for stage, dtype, optimizer in itertools.product(
                        args.stages, args.dtypes, args.optimizers
                    )
                    for save, load in worlds
                    if save == save_world
                ]
                keys = list(dict.fromkeys(c.key for c in group if (writer, c.stage, c.dtype) not in GAPS))
                written = run_batch(
                    pythons[writer], writer, save_world, "save", keys, root, args.steps, args.timeout
                )
                for key, record in written.items():
                    error = record.get("convert_error")
                    if "error" in record or not error:
                        continue
                    # The writer's own converter failed (DeepSpeed's ds_to_universal on stage 0 or on
                    # Muon's state): named in the cell, and the cell goes on with shardwise's converter.
                    record["converter"] = f"shardwise to-universal (ds_to_universal failed: {error})"
                    fallback = shardwise_convert(root, key, args.steps, args.timeout)
                    if fallback:
                        record["error"] = f"shardwise to-universal: {fallback}"
                for load_world in sorted({c.load_world for c in group}):
                    ready = [k for k in keys if "error" not in written.get(k, {"error": "not run"})]
                    read = run_batch(
                        pythons[reader], reader, load_world, "resume", ready, root, args.steps, args.timeout
                    )
                    for cell in (c for c in group if c.load_world == load_world):
                        gap = GAPS.get((writer, cell.stage, cell.dtype))
                        record = written.get(cell.key, {})
                        cell.converter = record.get("converter") or (
                            "ds_to_universal"
                            if writer == "deepspeed"
                            else "shardwise to-deepspeed (native stage 0)"
                            if cell.stage == 0
                            else "shardwise to-universal"
                        )
                        if gap is not None:
                            cell.status, cell.detail = "gap", gap
                        elif "error" in record:
                            side = (
                                "shardwise"
                                if record["error"].startswith("shardwise to-universal")
                                else writer
                            )
                            cell.status = "ds-limit" if side == "deepspeed" else "fail"
                            cell.detail = f"{side} save: {record['error']}"
                        elif "error" in read.get(cell.key, {}):
                            cell.status = "ds-limit" if reader == "deepspeed" else "fail"
                            cell.detail = f"{reader} resume: {read[cell.key]['error']}"
                        else:
                            judge(cell, record["losses"], read[cell.key]["losses"])
                        cells.append(cell)
                        diffs = ", ".join(f"{d:.1e}" for d in cell.diffs) or "-"
                        print(
                            f"{writer:>9} -> {reader:<9} stage {cell.stage} {cell.dtype} {cell.optimizer} "
                            f"{save_world}->{load_world} ranks via {cell.converter}: {cell.status:<8} "
                            f"diffs [{diffs}] {cell.detail}",
                            flush=True,
                        )
    print(f"{time.perf_counter() - began:.0f}s")
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
