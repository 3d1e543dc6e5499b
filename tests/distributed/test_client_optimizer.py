"""A client optimizer object is the one that steps (issue: it used to be rebuilt silently).

A client AdamW and a ``LambdaLR`` built on it, the scheduler passed to ``initialize`` or
stepped by the script, at ZeRO stages 0-3 (and with optimizer offload) on 2 gloo ranks:
the learning rate the engine applies is the scheduler's, before and after a checkpoint
round trip, torch does not warn that the scheduler stepped before its optimizer, and the
run matches the JSON optimizer's bit for bit.
"""

from __future__ import annotations

import client_optimizer_cases as cases
import pytest

from shardwise.testing import run_distributed_cases

pytestmark = pytest.mark.distributed

CASES = [
    *({"stage": stage, "pass_scheduler": passed} for stage in (0, 1, 2, 3) for passed in (True, False)),
    {"stage": 1, "pass_scheduler": True, "offload": True},
    {"stage": 3, "pass_scheduler": False, "offload": True},
]


def _id(case: dict) -> str:
    tail = "-offload" if case.get("offload") else ""
    return f"stage{case['stage']}-{'passed' if case['pass_scheduler'] else 'script'}{tail}"


@pytest.fixture(scope="module")
def stepping(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("client_optimizer"))
    results = run_distributed_cases(
        cases.client_optimizer_steps, CASES, world_size=2, args=(tmp,), timeout=900
    )
    return dict(zip(map(_id, CASES), results))


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_the_client_optimizer_steps_with_its_scheduler(stepping, case):
    for result in stepping[_id(case)]:
        assert result["returned_is_deepspeeds_choice"] and result["returned_scheduler_is_client"]
        expected = {
            "trained": cases.LR * cases._lambda(cases.STEPS),
            "loaded": cases.LR * cases._lambda(cases.STEPS),
            "after_load_step": cases.LR * cases._lambda(cases.STEPS + 1),
        }
        for moment, lr in expected.items():
            seen = result[moment]
            assert seen["stepping_is_client"], moment
            assert seen["client_has_state"], moment
            assert seen["engine"] == seen["client"] == seen["scheduler"] == [pytest.approx(lr, rel=1e-12)], (
                moment
            )
        assert result["warnings"] == []


def test_client_optimizer_matches_the_json_optimizer_bit_for_bit():
    stages = [0, 1, 2, 3]
    for stage, ranks in zip(
        stages, run_distributed_cases(cases.client_matches_json_optimizer, stages, 2, timeout=900)
    ):
        for result in ranks:
            assert result["count"] > 0 and result["equal"], (stage, result["flags"])
