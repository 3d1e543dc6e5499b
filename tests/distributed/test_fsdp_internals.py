"""comm.fsdp_internals on 2 gloo ranks: every FSDP2/DTensor internal it reads still means what it did.

A torch upgrade that moves one of these private attributes fails here, naming the accessor.
"""

from __future__ import annotations

from typing import Any

import pytest

from shardwise.testing import run_distributed_cases

pytestmark = pytest.mark.distributed


def _internals_case(rank: int, world: int, case: dict[str, Any]) -> bool:
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from shardwise import comm
    from shardwise.comm import fsdp_internals as fi

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 2))  # 15 + 3 weights: padded to 16 + 4 on 2 ranks
    full = [p.detach().clone() for p in model.parameters()]
    topology = comm.build_topology()
    fully_shard(model[0], mesh=topology.data_parallel_mesh("cpu"))
    fully_shard(model, mesh=topology.data_parallel_mesh("cpu"))
    unit = model[0]
    weight = unit.weight
    world_group = comm.get_world_group()

    assert fi.is_dtensor(weight) and not fi.is_dtensor(torch.ones(1)), "is_dtensor"
    local = fi.local_tensor(weight)
    assert type(local) is torch.Tensor and local.grad_fn is None, "local_tensor: a plain tensor"
    assert local.data_ptr() == weight.to_local().data_ptr(), "local_tensor: the shard's storage"
    assert torch.equal(fi.full_tensor(weight), full[0]), "full_tensor"
    assert fi.full_tensor(full[0]) is full[0], "full_tensor of a plain tensor"
    assert fi.dtensor_group(weight) is world_group, "dtensor_group"

    assert [id(p) for p in fi.unit_sharded_params(unit)] == [id(unit.weight), id(unit.bias)], (
        "unit_sharded_params"
    )
    # dim-0 shards of 3 and 3 rows padded to 2 rows per rank: weight 2x5, bias 2
    assert fi.unit_padded_shard_numel(unit) == [2 * 5 + 2], (
        f"unit_padded_shard_numel {fi.unit_padded_shard_numel(unit)}"
    )
    assert len(fi.unit_param_groups(unit)) == 1, "unit_param_groups"
    assert fi.unit_shard_groups(unit) == [world_group], "unit_shard_groups"
    fi.set_unshard_async(unit)
    assert [g.unshard_async_op for g in fi.unit_param_groups(unit)] == [True], "set_unshard_async"

    assert fi.is_fully_shard_class(type(unit)) and not fi.is_fully_shard_class(nn.Linear), (
        "is_fully_shard_class"
    )
    user_class = next(c for c in type(unit).__mro__ if not fi.is_fully_shard_class(c))
    assert user_class is nn.Linear, f"is_fully_shard_class: {type(unit).__mro__}"
    return True


def test_fsdp_and_dtensor_internals_on_two_ranks() -> None:
    results = run_distributed_cases(_internals_case, [{}], world_size=2, timeout=120)
    assert results == [[True, True]]  # one case, both ranks
