"""AutoEP folded over AutoTP on 4 gloo ranks: a tiny Mixtral-shaped model (two MoE layers, a
column/row-split dense MLP, layer norms, a replicated head) trained with ``expert_parallel.autoep_size``
beside ``tensor_parallel.autotp_size=2`` matches the plain model trained data-parallel on the same ranks
(each replica's batch on both lanes of its TP group), at ZeRO 0, 1 and 2, with expert groups inside a
TP group (ep=2) and across TP groups (ep=4, cross-lane).

Tolerance. Everything is fp32 and each routed assignment is computed once, so only summation order
differs: the TP all-reduce adds each token's per-lane partial sums (k=2 terms), the backward sums
per-lane partial gradients, the plain run averages four data-parallel gradients (two of each) where
the folded one averages two, and the experts' matrix products see other row counts. Each is a few
roundings of 2**-24 relative; over three SGD steps (lr 0.05, ~20 ops deep, gradient clipping at 1.0
applied alike) that bounds the drift by ~1e-6 of a value's scale, so parameters must agree within
``2e-6 * max(1, |p|max)`` and the loss within 2e-6 relative (measured: 6e-8 and 2.4e-7). A gradient
counted ``tp_size`` times, or a gradient norm missing the other lanes' experts (which changes the
clipping), moves parameters by ~1e-3 and fails.
"""

from __future__ import annotations

import pytest
from autoep_folding_cases import train_folded

from shardwise.testing import run_distributed_cases

pytestmark = pytest.mark.distributed

CASES = [{"tp": 2, "ep": 2, "stage": s} for s in (0, 1, 2)] + [{"tp": 2, "ep": 4, "stage": 2}]


@pytest.fixture(scope="module")
def folded_runs() -> list[list[dict]]:
    """Every case in one 4-rank spawn (the plain reference is trained once per spawn)."""
    return run_distributed_cases(train_folded, CASES, world_size=4, timeout=600)


@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"tp{c['tp']}-ep{c['ep']}-zero{c['stage']}" for c in CASES])
def test_folded_training_matches_the_plain_model(folded_runs: list[list[dict]], index: int) -> None:
    for rank, run in enumerate(folded_runs[index]):
        assert run["folded_layers"] == 2 and run["tp_size"] == 2, (rank, run["folded_layers"], run["tp_size"])
        assert run["names"], rank  # every parameter of the plain model has its folded counterpart
        for folded, plain in zip(run["loss"], run["plain_loss"], strict=True):
            assert abs(folded - plain) <= 2e-6 * abs(plain), (rank, run["loss"], run["plain_loss"])
        for name, difference in run["diff"].items():
            assert difference <= 2e-6 * max(1.0, run["scale"][name]), (rank, name, difference)
        assert run["loss"][-1] != run["loss"][0]  # it trained
