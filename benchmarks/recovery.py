"""Recovery benchmark: how long a killed rank costs, and what an async snapshot blocks.

One command, 2 CPU ranks through the ``shardwise`` launcher with ``--max_restarts 1``, the
benchmark GPT (``gpt_17m``, about 17M parameters) at ZeRO-2 fp32, a checkpoint after every
step; rank 1 SIGKILLs itself after the save of step ``--kill-at`` on the first attempt::

    python benchmarks/recovery.py                  # async snapshots (checkpoint.async_save)
    python benchmarks/recovery.py --sync           # blocking saves, for comparison
    python benchmarks/recovery.py --snapshot-interval 2   # no saves by the script: the engine's
                                                   # periodic snapshots (checkpoint.snapshot_interval)

Reported (from the ranks' JSON event lines, wall clock):

* ``recovery_s``: from the kill to the end of the first step after the restart (torch elastic's
  detection and restart, process start, ``initialize``, ``load_checkpoint``, one step);
* ``step_s``: the median step time before the kill;
* ``save_block_s`` and ``save_share``: the median time ``save_checkpoint`` blocked the loop,
  and that as a share of a step (with async snapshots only the copy to host memory blocks);
* with ``--snapshot-interval N``: ``step_s`` is the median step time less its snapshot's blocking part,
  ``save_block_s`` the median time the snapshot blocked inside ``engine.step()``,
  ``share_per_step`` that spread over the N steps it covers, ``resumed_at`` and ``redone``
  where the restarted ranks resumed and how many steps they trained again.

A benchmark, not a test: nothing asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--kill-at", type=int, default=5)
    parser.add_argument("--sync", action="store_true", help="blocking saves instead of async snapshots")
    parser.add_argument("--snapshot-interval", type=int, default=0, help="engine-driven snapshots every N steps")
    args = parser.parse_args()
    interval = args.snapshot_interval
    mode = f"s{interval}" if interval else ("0" if args.sync else "1")
    with tempfile.TemporaryDirectory() as scratch:
        ckpt = str(Path(scratch) / "ckpt")
        argv = [sys.executable, "-m", "shardwise.launcher", "--num_gpus", "2", "--max_restarts", "1",
                "--master_port", str(29700 + os.getpid() % 1000), str(HERE / "recovery_worker.py"), ckpt,
                str(args.steps), str(args.kill_at), mode]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        done = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
    # two ranks share stdout: lines may interleave, the objects do not nest
    events = [json.loads(found) for found in re.findall(r'\{"event"[^{}]*\}', done.stdout)]
    if done.returncode != 0 or not any(e["event"] == "killed" for e in events):
        sys.exit(f"the run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    killed = next(e for e in events if e["event"] == "killed")
    after = [e for e in events if e["event"] == "step" and e["restart"] == 1]
    before = [e for e in events if e["event"] == "step" and e["restart"] == 0 and e["step"] > 1]
    saves = [e for e in events if e["event"] == "save" and e["restart"] == 0 and e["step"] > 1]
    blocked = {(e["rank"], e["step"]): e["seconds"] for e in saves}
    # a snapshot blocks inside engine.step(): the step's own time is without it
    step_s = statistics.median(e["seconds"] - (blocked.get((e["rank"], e["step"]), 0.0) if interval else 0.0)
                               for e in before)  # fmt: skip
    save_s = statistics.median(e["seconds"] for e in saves)
    resumed = [e["step"] for e in events if e["event"] == "resumed" and e["restart"] == 1]
    result = {
        "mode": f"snapshot every {interval}" if interval else ("sync" if args.sync else "async"),
        "recovery_s": round(min(e["t"] for e in after) - killed["t"], 2),
        "resumed_at": min(resumed),
        "redone": killed["step"] - min(resumed),
        "step_s": round(step_s, 3),
        "save_block_s": round(save_s, 3),
        "save_share": round(save_s / step_s, 3),
        "share_per_step": round(save_s / step_s / max(interval, 1), 3),
        "load_average": os.getloadavg()[0],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
