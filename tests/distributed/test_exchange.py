"""shardwise.comm.exchange on 3 gloo ranks: reduce and gather over arbitrary owned ranges.

Values are small integers, so every sum is exact in fp32 and bf16 whatever the order of
the additions: results must equal the reference bit for bit. Messages are cut into many
pieces (a tiny ``PIECE_BYTES``), and several exchanges are in flight at once.
"""

from __future__ import annotations

from typing import Any

import pytest

from shardwise.testing import run_distributed_cases

pytestmark = pytest.mark.distributed

WORLD = 3
NUMEL = 50
# (lo, hi) per rank: uneven, one empty range, and elements nobody owns (40-50)
RANGES = [[(0, 7), (7, 7), (7, 40)], [(0, 17), (17, 34), (34, 50)], [(30, 50), (0, 12), (12, 30)]]


def _values(rank: int, seed: int, dtype: Any) -> Any:
    import torch

    g = torch.Generator().manual_seed(seed * 10 + rank)
    return torch.randint(-50, 50, (NUMEL,), generator=g).to(dtype)


def _exchange_case(rank: int, world: int, case: dict[str, Any]) -> Any:
    import torch

    from shardwise.comm import exchange

    exchange.PIECE_BYTES = 8  # many messages per range
    dtype = getattr(torch, case["dtype"])
    handles, checks = [], []
    for seed, owned in enumerate(RANGES):  # all three exchanges in flight together
        buffer = _values(rank, seed, dtype)
        before = buffer.clone()
        total = sum(_values(r, seed, torch.float64) for r in range(world))
        lo, hi = owned[rank]
        if case["kind"] == "reduce":
            out = torch.full((hi - lo,), float("nan"), dtype=dtype) if case["out"] else None
            handles.append(exchange.reduce_owned(buffer, owned, async_op=True, out=out))
            result = out if out is not None else buffer[lo:hi]  # a view: filled in by wait()
            checks.append((result, total[lo:hi].to(dtype), buffer, before, (lo, hi) if out is None else None))
        else:
            full = torch.full((NUMEL,), float("nan"), dtype=dtype)
            for r, (a, b) in enumerate(owned):
                if r == rank:
                    full[a:b] = before[a:b]
            expected = full.clone()
            for r, (a, b) in enumerate(owned):
                expected[a:b] = _values(r, seed, dtype)[a:b]
            handles.append(exchange.gather_owned(full, owned, async_op=True))
            checks.append((full, expected, None, None, None))
    for handle in reversed(handles):  # completion order does not matter
        assert handle.wait() and handle.is_completed()
    for result, expected, buffer, before, written in checks:
        torch.testing.assert_close(result, expected, rtol=0, atol=0, equal_nan=True)
        if buffer is not None:  # outside this rank's range (or everywhere, with out=) nothing changed
            keep = torch.ones(NUMEL, dtype=torch.bool)
            if written is not None:
                keep[written[0] : written[1]] = False
            torch.testing.assert_close(buffer[keep], before[keep], rtol=0, atol=0)
    # synchronous form, and the checks that run before any message is sent
    buffer = _values(rank, 7, dtype)
    assert exchange.reduce_owned(buffer, [(0, 10), (10, 20), (20, 50)]) is None
    errors = []
    for bad in ([(0, 10), (10, 20)], [(0, 10), (10, 20), (20, 51)]):
        try:
            exchange.reduce_owned(buffer, bad)
        except ValueError as exc:
            errors.append(str(exc))
    return errors


def test_reduce_and_gather_over_owned_ranges() -> None:
    cases = [{"kind": k, "dtype": d, "out": o} for k in ("reduce", "gather") for d in ("float32", "bfloat16")
             for o in ((False, True) if k == "reduce" else (False,))]  # fmt: skip
    results = run_distributed_cases(_exchange_case, cases, world_size=WORLD, timeout=120)
    for per_rank in results:
        for errors in per_rank:
            assert "one (lo, hi) range per rank" in errors[0]
            assert "outside the buffer" in errors[1]
