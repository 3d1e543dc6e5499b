"""The 1-bit compressed all-reduce on 2 and 3 gloo ranks, against its definition.

Every rank rebuilds every rank's inputs from per-rank seeds and runs the definition of the
two-stage scheme (worker compression with error feedback, server averaging and compression
with error feedback) in plain torch, for several consecutive calls, so the error buffers
carried over between calls are checked too. Sizes are uneven (not multiples of 8 x world).
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from shardwise.testing import run_distributed_cases

pytestmark = pytest.mark.distributed

CALLS = 4


def _inputs(world: int, numel: int, call: int) -> list[Any]:
    import torch

    return [
        torch.randn(numel, generator=torch.Generator().manual_seed(1000 * call + r)) * (r + 1)
        for r in range(world)
    ]


def _signs(x: Any) -> Any:
    import torch

    return torch.where(x >= 0, 1.0, -1.0)


def _definition(world: int, numel: int) -> tuple[list[Any], list[list[Any]], list[Any]]:
    """(results per call, worker errors per call per rank, server errors of the last call per rank)."""
    import torch

    unit = 8 * world
    padded = max(unit, -(-numel // unit) * unit)
    chunk = padded // world
    worker = [torch.zeros(padded) for _ in range(world)]
    server = [torch.zeros(chunk) for _ in range(world)]
    results, worker_history = [], []
    for call in range(CALLS):
        compressed = []
        for r, x in enumerate(_inputs(world, numel, call)):
            w = torch.zeros(padded)
            w[:numel] = x
            w += worker[r]
            scale = torch.linalg.vector_norm(w) / math.sqrt(padded)
            compressed.append(_signs(w) * scale)
            worker[r] = w - compressed[-1]
        worker_history.append([e.clone() for e in worker])
        out = []
        for j in range(world):
            m = torch.zeros(chunk)
            for r in range(world):
                m += compressed[r][j * chunk : (j + 1) * chunk]
            m = m / world + server[j]
            scale = torch.linalg.vector_norm(m) / math.sqrt(chunk)
            out.append(_signs(m) * scale)
            server[j] = m - out[-1]
        results.append(torch.cat(out)[:numel])
    return results, worker_history, server


def _case(rank: int, world: int, numel: int) -> dict[str, Any]:
    import torch

    from shardwise.comm.compressed_allreduce import CompressedAllReduce

    reducer = CompressedAllReduce(numel)
    expected, worker_history, server = _definition(world, numel)
    worst = 0.0
    for call in range(CALLS):
        x = _inputs(world, numel, call)[rank].clone()
        reducer.average(x)
        worst = max(worst, float((x - expected[call]).abs().max()))
        werr = float((reducer.worker_error - worker_history[call][rank]).abs().max())
        worst = max(worst, werr)
    worst = max(worst, float((reducer.server_error - server[rank]).abs().max()))
    low, high = x.clone(), x.clone()
    torch.distributed.all_reduce(low, op=torch.distributed.ReduceOp.MIN)
    torch.distributed.all_reduce(high, op=torch.distributed.ReduceOp.MAX)
    return {"worst": worst, "identical_on_ranks": bool(torch.equal(low, high))}


@pytest.mark.parametrize("world", [2, 3])
def test_compressed_allreduce_matches_its_definition(world: int) -> None:
    cases = [1, 13, 1000, 4099]
    results = run_distributed_cases(_case, cases, world_size=world, timeout=180)
    for numel, per_rank in zip(cases, results):
        for r, out in enumerate(per_rank):
            # the same operations in the same order: bit-exact
            assert out["worst"] == 0.0, (numel, r, out)
            assert out["identical_on_ranks"], (numel, r, out)
