"""Stages 1-2 with ``overlap_comm: true``: the post-step all-gather runs behind the next forward
(:mod:`shardwise.zero.async_gather`), and everything is bit-identical to ``overlap_comm: false``:
losses, parameters, reads between step() and the next forward (eval forward, state_dict, the
fp32 accessors), and checkpoints saved or loaded right after step().

The overlap is gloo's: these ranks share a host, so they run with ``SHARDWISE_SHM_COLLECTIVES=0``
(on one host the shared-memory transport gathers inside the step, leaving nothing in flight:
``test_shared_memory_transport.py``)."""

from __future__ import annotations

import pytest
import torch
from overlap_gather_cases import checkpoint_after_step, reads_child_weight, train_both

from shardwise.testing import run_distributed_cases

GLOO = {"SHARDWISE_SHM_COLLECTIVES": "0"}

pytestmark = [pytest.mark.distributed, pytest.mark.numeric]

CASES = [
    {"stage": stage, "precision": precision, "gas": gas, **({"clip": 0.05} if gas == 2 else {})}
    for stage in (1, 2)
    for precision in ("fp32", "bf16")
    for gas in (1, 2)
]
CASES += [
    {"stage": 2, "precision": "fp32", "gas": 1, "fused": True},
    {"stage": 1, "precision": "bf16", "gas": 2, "fused": True, "clip": 0.05},
    {"stage": 2, "precision": "fp32", "gas": 1, "model": reads_child_weight},
]
CKPT_CASES = [{"stage": 1, "precision": "fp32", "gas": 1}, {"stage": 2, "precision": "bf16", "gas": 2}]


def _id(case: dict) -> str:
    extra = "".join(f"-{k}" for k in ("clip", "fused", "model") if k in case)
    return "stage{stage}-{precision}-gas{gas}".format(**case) + extra


@pytest.fixture(scope="module")
def results():
    return dict(
        zip(map(_id, CASES), run_distributed_cases(train_both, CASES, world_size=2, timeout=900, env=GLOO))
    )


def _equal(a, b) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _equal(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _equal(x, y)
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    else:
        assert a == b


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_overlap_is_bit_identical_to_synchronous(results, case):
    for rank in results[_id(case)]:
        sync, overlap = rank["False"], rank["True"]
        assert sync["busy"] == [False] * 3
        assert overlap["busy"] == [True] * 3  # the gathers really were left in flight
        _equal(overlap["losses"], sync["losses"])
        _equal(overlap["probes"], sync["probes"])  # eval forward, state_dict, fp32 accessors after step()
        _equal(overlap["final"], sync["final"])
    ranks = results[_id(case)]
    _equal(ranks[0]["True"]["final"], ranks[1]["True"]["final"])  # every rank holds the same parameters


@pytest.mark.parametrize("case", CKPT_CASES, ids=_id)
def test_checkpoint_right_after_step_equals_synchronous(case, tmp_path):
    ranks = run_distributed_cases(
        checkpoint_after_step, [case], world_size=2, args=(str(tmp_path),), timeout=600, env=GLOO
    )[0]
    for rank in ranks:
        sync, overlap = rank["False"], rank["True"]
        _equal(overlap["loaded"], sync["loaded"])
        _equal(overlap["after_save"], sync["after_save"])
        _equal(overlap["resumed"], sync["resumed"])
        _equal(overlap["resumed"], overlap["after_save"])  # the load restored the saved step exactly
        _equal(overlap["final"], sync["final"])
