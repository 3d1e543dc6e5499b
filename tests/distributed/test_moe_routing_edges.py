"""MoE on 2 gloo ranks: experts that receive no token, and ZeRO-3 leaf modules.

A rank whose experts receive no token still takes part in every all-to-all (blocks have a fixed
size: empty slots travel as zeros) and in every gradient reduction (the expert's gradient is
exactly zero, and it is reduced like any other), so training neither hangs nor desynchronises;
the idle experts' weights stay bitwise unchanged under SGD. The harness's timeout turns a hang
into a failure.
"""

from __future__ import annotations

import pytest
from moe_edge_cases import idle_experts, leaf_units

from shardwise.testing import run_distributed_cases

pytestmark = pytest.mark.distributed

IDLE = [{"stage": stage, "drop_tokens": drop} for stage in (0, 1, 2) for drop in (True, False)]


def test_experts_without_tokens_neither_hang_nor_change() -> None:
    results = run_distributed_cases(idle_experts, IDLE, world_size=2, timeout=240)
    for case, per_rank in zip(IDLE, results):
        for rank, result in enumerate(per_rank):
            assert all(count[1:] == [0, 0, 0] and count[0] == 20 for count in result["counts"]), (case, result)
            idle = {n: c for n, c in result["changed"].items()}
            if rank == 1:  # experts 2 and 3: never routed to
                assert idle and not any(idle.values()), (case, idle)
            else:  # expert 0 trained, expert 1 idle
                assert any(c for n, c in idle.items() if "deepspeed_experts.0." in n), (case, idle)
                assert not any(c for n, c in idle.items() if "deepspeed_experts.1." in n), (case, idle)


def test_z3_leaf_modules_are_one_shard_unit_each() -> None:
    without, with_leaf = run_distributed_cases(leaf_units, [{"leaf": False}, {"leaf": True}], world_size=2, timeout=240)
    assert with_leaf[0] == with_leaf[1]
    assert "moe.deepspeed_moe.experts" in with_leaf[0]
    assert not any(u.startswith("moe.deepspeed_moe.experts.") for u in with_leaf[0])  # nothing split under it
    assert "moe.deepspeed_moe.experts" not in without[0]


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_full_gradient_of_an_expert_is_its_ep1_gradient(stage: int) -> None:
    import torch
    from moe_edge_cases import full_expert_gradients

    cases = [{"stage": stage, "ep": 1}, {"stage": stage, "ep": 2}]
    ep1, ep2 = run_distributed_cases(full_expert_gradients, cases, world_size=2, timeout=240)
    owned = {**ep2[0], **ep2[1]}
    assert sorted(owned) == sorted(ep1[0])
    for key, value in ep1[0].items():
        torch.testing.assert_close(owned[key], value, rtol=1e-6, atol=1e-7, msg=key)
    assert any(float(v.abs().sum()) > 0 for k, v in owned.items() if k.startswith("grad"))


def test_expert_buffers_stay_their_ranks_and_a_one_file_save_is_refused() -> None:
    from moe_edge_cases import expert_buffers

    (per_rank,) = run_distributed_cases(expert_buffers, [{}], world_size=2, timeout=240)
    assert per_rank[0] == {"dense": 0.0, "expert0": 0.0, "expert1": 1.0, "refused_16bit": 1.0}
    assert per_rank[1] == {"dense": 0.0, "expert0": 10.0, "expert1": 11.0, "refused_16bit": 1.0}
