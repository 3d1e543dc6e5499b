"""Folded AutoEP+AutoTP dispatch on 2 gloo ranks forming one tensor-parallel group: each lane
restores every token's output from its own rows, bit-equal to the unpartitioned combine (computed
here in fp64; inputs exact in fp32 by construction), and the lanes' gradients add up to the gradient
of the summed per-lane losses, also when one lane owns no row; a payload that differs by one ulp is
refused on both lanes by field name; the input gradient is averaged over the lanes."""

from __future__ import annotations

import pytest
import torch
from tp_dispatch_cases import check

from shardwise.testing import run_distributed_cases

pytestmark = pytest.mark.distributed

RESTORE = [{"check": "restore", "seed": 0, "validate": True}, {"check": "restore", "seed": 1, "validate": False},
           {"check": "restore", "seed": 2, "validate": True, "one_row_per_expert": True}]


@pytest.fixture(scope="module")
def runs() -> list[list]:
    """Every case in one spawn."""
    return run_distributed_cases(check, [*RESTORE, {"check": "divergent"}, {"check": "average"}], world_size=2,
                                 timeout=120)


def _reference(lanes: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The unpartitioned combine in fp64 and its gradients for the summed losses of all lanes."""
    tokens, weights, active = (t.double() if t.is_floating_point() else t for t in lanes[0]["payload"])
    results = lanes[0]["results"].double().requires_grad_(True)
    weights = weights.clone().requires_grad_(True)
    out = torch.zeros(lanes[0]["out"].shape, dtype=torch.float64)
    for row in active.nonzero().flatten().tolist():
        out[tokens[row]] = out[tokens[row]] + weights[row] * results[row]
    sum(((out * (rank + 1) * lane["loss_weights"].double()).sum() for rank, lane in enumerate(lanes))).backward()
    return out.detach(), results.grad, weights.grad


def test_lanes_restore_the_unpartitioned_combine_and_its_gradients(runs: list[list]) -> None:
    for case, lanes in zip(RESTORE, runs, strict=False):
        out, value_grad, weight_grad = _reference(lanes)
        rows = [lane["rows"] for lane in lanes]
        assert (rows[1] == 0) if case.get("one_row_per_expert") else min(rows) > 0, (case, rows)
        for lane in lanes:
            assert torch.equal(lane["out"].double(), out), case
        assert torch.equal((lanes[0]["value_grad"] + lanes[1]["value_grad"]).double(), value_grad), case
        assert torch.equal((lanes[0]["weight_grad"] + lanes[1]["weight_grad"]).double(), weight_grad), case
        assert value_grad.abs().sum() > 0 and weight_grad.abs().sum() > 0


def test_divergent_payloads_are_refused_on_every_lane(runs: list[list]) -> None:
    errors = runs[len(RESTORE)]
    assert all("routing decisions differ" in e and "['combine_weights']" in e for e in errors), errors


def test_the_input_gradient_is_averaged_over_the_lanes(runs: list[list]) -> None:
    grads = runs[len(RESTORE) + 1]
    assert all(torch.equal(g, torch.full((2, 3), 6.0)) for g in grads), grads
