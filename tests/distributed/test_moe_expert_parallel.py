"""Expert parallelism on 2 gloo ranks: EP=2 trains exactly like EP=1 at ZeRO stages 0-2.

Tolerance 1e-6 (fp32). Why the two runs agree: gating is per rank on the same tokens and the same
random stream; each expert computes each token alone, so moving a token to the expert's owner by
all-to-all changes no value; the dense dispatch and combine sum one or two non-zero products with
zeros. An expert's gradient at EP=2 is the sum over both ranks' tokens on its owner (the
all-to-all's backward), which ZeRO divides by the data-parallel size 2, the mean an EP=1 run's
all-reduce gives (DeepSpeed's convention). What remains is the order of float additions inside
matrix products of different row counts (an expert sees 2C rows at EP=2, C per rank at EP=1), a
few ulps of fp32 per step; Adam's update is bounded by its learning rate, so 20 steps stay far
below 1e-6 in the loss.
"""

from __future__ import annotations

import pytest
import torch
from moe_cases import train

from shardwise.testing import run_distributed_cases

pytestmark = pytest.mark.distributed

STEPS = 20
# SGD: a wrong scaling of expert gradients changes its update; "clipped": SGD with gradient_clipping
# below the gradient norm, so the norm (which adds the other expert-parallel ranks' experts) scales it
OPTIMIZERS = ("Adam", "SGD", "clipped")
CLIP = 0.05
CASES = [
    {"stage": stage, "ep": ep, "steps": STEPS, "optimizer": "SGD" if name == "clipped" else name,
     "clip": CLIP if name == "clipped" else 0.0, "name": name}
    for name in OPTIMIZERS
    for stage in (0, 1, 2)
    for ep in (1, 2)
]


@pytest.fixture(scope="module")
def runs() -> dict[tuple[str, int, int], list[dict]]:
    results = run_distributed_cases(train, CASES, world_size=2, timeout=600)
    return {(c["name"], c["stage"], c["ep"]): r for c, r in zip(CASES, results)}


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_ep2_matches_ep1_loss_and_balancing_loss(runs: dict, stage: int, optimizer: str) -> None:
    for rank in range(2):
        ep1, ep2 = runs[(optimizer, stage, 1)][rank], runs[(optimizer, stage, 2)][rank]
        assert max(abs(a - b) for a, b in zip(ep1["loss"], ep2["loss"])) <= 1e-6, (rank, ep1["loss"], ep2["loss"])
        assert max(abs(a - b) for a, b in zip(ep1["aux"], ep2["aux"])) <= 1e-6, (rank, ep1["aux"], ep2["aux"])
        assert ep1["loss"][-1] < ep1["loss"][0]  # it trains
        for a, b in zip(ep1["norm"], ep2["norm"]):  # the norm counts every expert once
            assert b == pytest.approx(a, rel=1e-5), (rank, ep1["norm"], ep2["norm"])
        if optimizer == "clipped":
            assert min(ep1["norm"]) > CLIP  # clipping acted on every step


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_ep2_holds_half_the_expert_parameters_and_the_same_expert_weights(
    runs: dict, stage: int, optimizer: str
) -> None:
    ep1, ep2 = runs[(optimizer, stage, 1)], runs[(optimizer, stage, 2)]
    assert ep2[0]["expert_numel"] * 2 == ep1[0]["expert_numel"] == ep1[1]["expert_numel"]
    owned = {**ep2[0]["experts"], **ep2[1]["experts"]}
    assert sorted(owned) == sorted(ep1[0]["experts"])
    for key, value in ep1[0]["experts"].items():
        torch.testing.assert_close(owned[key], value, rtol=0, atol=1e-5, msg=key)
