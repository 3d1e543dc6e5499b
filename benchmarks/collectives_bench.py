"""Collectives benchmark: the algorithms ZeRO can use for reduce-scatter and all-gather, side by side.

One command, 2 CPU ranks (gloo, one intra-op thread each), fp32 and bf16 flat buffers from 1 to
64 MiB; for each size, in interleaved rounds so machine noise hits every column alike::

    python benchmarks/collectives_bench.py            # ~1-2 minutes
    python benchmarks/collectives_bench.py --world-size 3 --sizes 4 16
    python benchmarks/collectives_bench.py --out results.json

Columns (median ms of the slower rank, then the ratio to the in-place all-reduce of the whole buffer,
which is what a reduce-scatter or all-gather cost before ``shardwise.comm.exchange``):

* ``all_reduce``: ``dist.all_reduce`` of the buffer, in place;
* ``rs native`` / ``rs exchange``: ``shardwise.comm.reduce_scatter_flat`` with ``algorithm="native"``
  (torch's ``reduce_scatter_single``) / ``"exchange"`` (point-to-point, see ``comm/exchange.py``);
* ``ag native`` / ``ag exchange``: ``all_gather_flat`` likewise;
* ``1-bit``: ``shardwise.comm.compressed_allreduce.CompressedAllReduce.average`` of the buffer (the
  error-compensated 1-bit average of 1-bit Adam: sign bits packed 8 per byte, an all-to-all and
  an all-gather of 1/8 and 1/(8 x world) of the fp32 bytes, scales, compression on the CPU);
  fp32 rows only (the 1-bit optimizers compress fp32 momentum).

A second table gives the bytes one rank sends per call, fp32 all-reduce against the 1-bit one.

``shardwise.comm.collectives.choose_algorithm`` picks from these numbers. This is a benchmark, not
a test: nothing here asserts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))

COLUMNS = ["all_reduce", "rs native", "rs exchange", "ag native", "ag exchange", "1-bit"]


def _calls(full: Any, shard: Any) -> dict[str, Any]:
    """One callable per column, over this size's buffers."""
    import torch
    import torch.distributed as dist

    from shardwise.comm import collectives
    from shardwise.comm.compressed_allreduce import CompressedAllReduce

    calls = {
        "all_reduce": lambda: dist.all_reduce(full),
        "rs native": lambda: collectives.reduce_scatter_flat(shard, full, algorithm="native"),
        "rs exchange": lambda: collectives.reduce_scatter_flat(shard, full, algorithm="exchange"),
        "ag native": lambda: collectives.all_gather_flat(full, shard, algorithm="native"),
        "ag exchange": lambda: collectives.all_gather_flat(full, shard, algorithm="exchange"),
    }
    if full.dtype == torch.float32:
        onebit = CompressedAllReduce(full.numel())
        calls["1-bit"] = lambda: onebit.average(full)
    return calls


def _rank_main(rank: int, world: int, sizes_mib: list[int], rounds: int) -> list[dict[str, Any]]:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for mib in sizes_mib:
            numel = mib * 2**20 // torch.tensor([], dtype=dtype).element_size()
            numel -= numel % world
            full = torch.randn(numel).to(dtype)
            shard = torch.empty(numel // world, dtype=dtype)
            calls = _calls(full, shard)
            times: dict[str, list[float]] = {name: [] for name in calls}
            for _ in range(rounds):
                for name, call in calls.items():
                    dist.barrier()
                    t0 = time.perf_counter()
                    call()
                    elapsed = torch.tensor([time.perf_counter() - t0])
                    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slower rank counts
                    times[name].append(float(elapsed))
            rows.append(
                {
                    "dtype": str(dtype).removeprefix("torch."),
                    "mib": mib,
                    "numel": numel,
                    "ms": {name: 1e3 * statistics.median(values[1:]) for name, values in times.items()},
                }
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 16, 64], help="buffer sizes in MiB")
    parser.add_argument(
        "--rounds", type=int, default=9, help="calls per column and size (the first is dropped)"
    )
    parser.add_argument("--out", type=Path, help="write the numbers to this JSON file")
    args = parser.parse_args(argv)

    from shardwise.testing import run_distributed

    rows = run_distributed(_rank_main, args.world_size, args=(args.sizes, args.rounds), timeout=900)[0]
    print(
        f"collectives: {args.world_size} gloo ranks x 1 thread; median ms of the slower rank (x all_reduce)"
    )
    print(f"{'dtype':9} {'MiB':>4} " + " ".join(f"{c:>20}" for c in COLUMNS))
    for row in rows:
        base = row["ms"]["all_reduce"]
        cells = [
            f"{row['ms'][c]:8.1f} ({row['ms'][c] / base:4.2f}x)" if c in row["ms"] else "-" for c in COLUMNS
        ]
        print(f"{row['dtype']:9} {row['mib']:>4} " + " ".join(f"{cell:>20}" for cell in cells))
    from shardwise.comm.compressed_allreduce import compressed_bytes

    print("bytes one rank sends per call (fp32): all_reduce 4n, 1-bit n/8 + n/(8 x world) + scales")
    for row in rows:
        if row["dtype"] == "float32":
            fp32, onebit = 4 * row["numel"], compressed_bytes(row["numel"], args.world_size)
            print(f"  {row['mib']:>4} MiB: {fp32:>12,} vs {onebit:>10,} ({fp32 / onebit:.1f}x fewer)")
    if args.out:
        args.out.write_text(json.dumps({"world_size": args.world_size, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
