"""ZeRO stages 0-2 on 2 gloo ranks against the single-process reference (zero_reference.py).

Tolerances. The reference runs the same kernels on the same micro-batch shapes with one
thread per process (as the ranks do), accumulates gradients in fp32 in the same order as
the reduction (per rank then across ranks at stages 0/1; across ranks per micro batch at
stage 2), and clipping is off in the grid, so the gradient multiplier is the exact power
of two 1/(W * loss_scale). Under those conditions the results are bitwise equal, and the
grid asserts equality to 1e-6 relative (fp32, bf16 and fp16 alike): any deviation is a
bug, not rounding. With clipping, the parameters are bitwise equal too, by construction:
the reference takes the multiplier from the engine's reported norm, and the norm itself is
checked against the exact norm within a derived worst-case bound (zero_reference's module
docstring and ``norm_error_bound``), because the engine sums it shard by shard and the
rounding of that sum depends on the CPU's vector width.

Every case runs under both transports of a one-host gloo group: shared memory (the default) and
gloo itself (``SHARDWISE_SHM_COLLECTIVES=0``, the multi-host path).
"""

from __future__ import annotations

import pytest
import torch
from zero_reference import norm_error_bound, rank_train, reference_run

from shardwise.testing import run_distributed_cases

pytestmark = [pytest.mark.distributed, pytest.mark.numeric]

WORLD, STEPS, MICRO = 2, 3, 2
GRID = [
    {"stage": stage, "precision": precision, "gas": gas, "micro_batch": MICRO, "steps": STEPS}
    for stage in (0, 1, 2)
    for precision in ("fp32", "bf16", "fp16")
    for gas in (1, 4)
]
# the whole model in one reduce bucket (stages 0-1 on one host: one shared-memory reduction per backward)
ONE_BUCKET = [
    {
        "stage": stage,
        "precision": precision,
        "gas": 4,
        "micro_batch": MICRO,
        "steps": STEPS,
        "zero": {"reduce_bucket_size": 10**8},
    }
    for stage in (1, 2)
    for precision in ("fp32", "bf16")
]
CLIP_CASES = [
    {"stage": stage, "precision": "fp32", "gas": 2, "micro_batch": MICRO, "steps": 2, "clip": 0.05}
    for stage in (0, 1, 2)
]
GAS_CASES = [
    {"stage": 2, "precision": "fp32", "gas": 1, "micro_batch": 8, "steps": 2, "same_data": True},
    {"stage": 2, "precision": "fp32", "gas": 2, "micro_batch": 4, "steps": 2, "same_data": True},
    {"stage": 1, "precision": "fp32", "gas": 2, "micro_batch": 4, "steps": 2, "same_data": True},
]
CASES = GRID + ONE_BUCKET + CLIP_CASES + GAS_CASES


def _id(case: dict) -> str:
    extra = f"-clip{case['clip']}" if "clip" in case else ""
    extra += "-one_bucket" if "zero" in case else ""
    return "stage{stage}-{precision}-gas{gas}-micro{micro_batch}".format(**case) + extra


TRANSPORTS = {"shm": {}, "gloo": {"SHARDWISE_SHM_COLLECTIVES": "0"}}


@pytest.fixture(scope="module", params=list(TRANSPORTS))
def results(request):
    runs = run_distributed_cases(
        rank_train, CASES, world_size=WORLD, timeout=900, env=TRANSPORTS[request.param]
    )
    return dict(zip(map(_id, CASES), runs))


@pytest.mark.parametrize("case", GRID + ONE_BUCKET, ids=_id)
def test_matches_single_process_reference(results, case):
    ref = reference_run(
        case["precision"], case["gas"], MICRO, WORLD, STEPS, reduce_every_micro=case["stage"] == 2
    )
    ranks = results[_id(case)]
    for rank_result in ranks:
        assert rank_result["steps"] == STEPS and rank_result["skipped"] == 0
        for key, value in rank_result["losses"].items():
            assert value == pytest.approx(ref["losses"][key], rel=1e-6, abs=1e-7), key
    final = ranks[0]["params"]
    assert len(final) == len(ref["params"])
    for ours, theirs in zip(final, ref["params"]):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-8)
    for a, b in zip(ranks[0]["params"], ranks[1]["params"]):
        assert torch.equal(a, b)  # every rank holds the same parameters after the all-gather


@pytest.mark.parametrize("case", CLIP_CASES, ids=_id)
def test_global_norm_clipping_matches_reference(results, case):
    ranks = results[_id(case)]
    ref = reference_run(
        "fp32",
        case["gas"],
        MICRO,
        WORLD,
        case["steps"],
        reduce_every_micro=case["stage"] == 2,
        clip=case["clip"],
        engine_norms=ranks[0]["norms"],
    )
    assert all(n > case["clip"] for n in ref["norms"]), "the test must actually clip"
    tensors = len(ref["params"])
    for rank_result in ranks:
        assert rank_result["norms"] == ranks[0]["norms"]  # every rank applies the same multiplier
        for ours, exact in zip(rank_result["norms"], ref["norms"]):
            assert abs(ours - exact) <= norm_error_bound(exact, ref["largest_tensor"], tensors, WORLD)
    for ours, theirs in zip(ranks[0]["params"], ref["params"]):
        assert torch.equal(ours, theirs)


def test_accumulation_is_equivalent_to_a_bigger_micro_batch(results):
    one = results[_id(GAS_CASES[0])][0]["params"]
    for case in GAS_CASES[1:]:
        for a, b in zip(one, results[_id(case)][0]["params"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
