"""A caller-run backward on the engine's outputs (``loss.backward()``, ``engine.scale(loss).backward()``)
trains as ``engine.backward(loss)`` does, at ZeRO stages 0-3 on 2 gloo ranks (DeepSpeed 0.19.8 allows
it at stages 1-3 and refuses it at 0; shardwise serves stage 0 too).

Exact by construction with 2 accumulation steps: the engine divides the loss by 2, the hooks divide
each output's gradient by 2; halving is exact in binary floating point, so both backwards produce the
same bits, and SGD with momentum (which, unlike Adam, sees any gradient scale error) steps the same
parameters. With 3 steps the two divisions round differently, by at most half an ulp of each output
gradient element; after 3 SGD steps of lr 0.1 from parameters of order 1 that bounds the parameter
difference far below the asserted 1e-6.
"""

from __future__ import annotations

import pytest
import torch
from direct_backward_cases import MICRO_BATCHES, run

from shardwise.testing import run_distributed_cases

pytestmark = pytest.mark.distributed

STAGES = (0, 1, 2, 3)
CASES = [{"stage": s, "gas": 2, "mode": m} for s in STAGES for m in ("engine", "direct", "scale")]
CASES += [{"stage": 2, "gas": 3, "mode": m} for m in ("engine", "direct")]
CASES += [{"stage": s, "gas": 2, "mode": "penalty"} for s in (1, 2)]
CASES += [{"stage": s, "gas": 2, "mode": m, "fp16": True} for s in (0, 3) for m in ("engine", "direct", "scale")]


@pytest.fixture(scope="module")
def runs() -> dict[tuple, list[dict]]:
    results = run_distributed_cases(run, CASES, world_size=2, timeout=600)
    return {(c["stage"], c["gas"], c["mode"], c.get("fp16", False)): r for c, r in zip(CASES, results, strict=True)}


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("mode", ["direct", "scale"])
def test_caller_backward_trains_as_engine_backward(runs: dict, stage: int, mode: str) -> None:
    for reference, caller in zip(runs[(stage, 2, "engine", False)], runs[(stage, 2, mode, False)], strict=True):
        assert caller["refused"] is None
        assert caller["loss"] == reference["loss"]
        for name, value in reference["params"].items():
            assert torch.equal(caller["params"][name], value), name
        assert caller["counters"] == reference["counters"] == (MICRO_BATCHES // 2, MICRO_BATCHES * 4 * 2, MICRO_BATCHES)
    first = runs[(stage, 2, "engine", False)][0]["loss"]
    assert first[-1] < first[0]  # it trains


def test_three_accumulation_steps_within_one_rounding(runs: dict) -> None:
    for reference, caller in zip(runs[(2, 3, "engine", False)], runs[(2, 3, "direct", False)], strict=True):
        assert caller["counters"] == reference["counters"] == (MICRO_BATCHES // 3, MICRO_BATCHES * 4 * 2, MICRO_BATCHES)
        for name, value in reference["params"].items():
            torch.testing.assert_close(caller["params"][name], value, rtol=0, atol=1e-6)


@pytest.mark.parametrize("stage", [0, 3])
def test_fp16_needs_the_scaled_loss(runs: dict, stage: int) -> None:
    for rank_result in runs[(stage, 2, "direct", True)]:
        assert rank_result["refused"] is not None and "engine.scale(loss).backward()" in rank_result["refused"]
        assert rank_result["loss"] == []
    for reference, scaled in zip(runs[(stage, 2, "engine", True)], runs[(stage, 2, "scale", True)], strict=True):
        assert scaled["loss"] == reference["loss"]
        for name, value in reference["params"].items():
            assert torch.equal(scaled["params"][name], value), name


@pytest.mark.parametrize("stage", [1, 2])  # a double backward through FSDP2 (stage 3) is not supported
def test_gradient_penalty_through_the_outputs_is_no_micro_step(runs: dict, stage: int) -> None:
    """``torch.autograd.grad(engine(x), x)`` accumulates into no parameter: its input gradient is not
    divided by the accumulation steps and it counts no backward."""
    for reference, penalized in zip(runs[(stage, 2, "engine", False)], runs[(stage, 2, "penalty", False)], strict=True):
        ((penalty, expected),) = penalized["penalties"]
        assert penalty == expected
        assert penalized["counters"] == reference["counters"]
