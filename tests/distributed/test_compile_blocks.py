"""``engine.compile()`` at ZeRO stages 0-3 on 2 gloo ranks: per-block compilation of the engine
benchmark's GPT (``TinyGPT``, shrunk), against the same run eager, 50 steps each.

Backend and error bound. ``aot_eager`` captures each block with dynamo, traces its forward and
backward with AOT autograd (autograd's own derivative formulas) and runs the two graphs with the
ATen kernels eager runs, in the same order, without fusing or recomputing: on the same shapes in the
same process the losses are equal bit for bit by construction, which the test asserts (the
acceptance bound, 1e-5 over 50 steps, is then met with room). This covers the compiled forward and
backward against the engine at each stage: the graph's saved parameters while FSDP2 frees and
re-gathers them around each block (stage 3), ZeRO's hooks around the graph. Inductor fuses kernels,
so its parity is a tolerance, measured by ``benchmarks/compile_bench.py`` outside ``make test``.

Dynamo's counters: ``CompileCounterWithBackend`` counts the frames dynamo compiles. The two blocks
share one code object and one graph, so one frame means no graph break inside a block (a break
splits a block into two frames, and ``counters["graph_break"]`` counts it) and the same count
after the first step and after the 50th means no recompile after warm-up.
"""

from __future__ import annotations

import pytest
from compile_cases import STEPS, compiled_against_eager

from shardwise.testing import run_distributed_cases

pytestmark = pytest.mark.distributed

CASES = [{"stage": stage, "gas": 1, "backend": "aot_eager"} for stage in (0, 1, 2, 3)]


def _id(case: dict) -> str:
    return "stage{stage}-gas{gas}".format(**case)


@pytest.fixture(scope="module")
def results() -> dict[str, list[dict]]:
    runs = run_distributed_cases(compiled_against_eager, CASES, world_size=2, timeout=600)
    return dict(zip(map(_id, CASES), runs))


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_compiled_loss_equals_eager(results, case) -> None:
    for rank in results[_id(case)]:
        assert len(rank["compiled"]) == STEPS * case["gas"]
        assert rank["compiled"] == rank["eager"]  # bitwise (module docstring), hence within 1e-5
        assert rank["compiled"][-1] < rank["compiled"][0]  # it trains


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_each_block_compiles_once_without_breaks(results, case) -> None:
    for rank in results[_id(case)]:
        assert rank["is_compiled"] and rank["targets"] == ["blocks.0", "blocks.1"]
        assert rank["graph_breaks"] == 0
        assert rank["frames_after_warmup"] == 1, "one graph for both blocks (a break would add frames)"
        assert rank["frames_at_end"] == rank["frames_after_warmup"], "recompiled after warm-up"
        assert rank["ops_per_graph"] >= 10  # the whole block: attention and MLP, not a fragment
    if case["stage"] == 3:  # the compiled blocks are FSDP2's shard units
        assert results[_id(case)][0]["block_class"].startswith("FSDP")
