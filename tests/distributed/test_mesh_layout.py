"""comm.mesh on 4 real gloo ranks: declared degrees become groups every feature reads.

One spawn runs every case. Each case checks the groups against the pure rank arithmetic
(``ParallelDims.rank_groups``) *and* by a collective over each group (a sum of world ranks
equals the sum of the group's members), so a group that names the right ranks but was
built wrongly fails too.
"""

from __future__ import annotations

from typing import Any

import pytest

from shardwise.testing import run_distributed_cases

pytestmark = pytest.mark.distributed

WORLD = 4


def _check_groups(topology: Any, dims: tuple[str, ...]) -> None:
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    for dim in dims:
        ranks = topology.ranks_of(dim)
        assert rank in ranks and topology.size_of(dim) == len(ranks), (dim, ranks)
        assert ranks[topology.rank_in(dim)] == rank
        assert [g for g in topology.dims.rank_groups(dim) if rank in g] == [list(ranks)], dim
        if len(ranks) > 1:
            total = torch.tensor([float(rank)])
            dist.all_reduce(total, group=topology.group_of(dim))
            assert total.item() == float(sum(ranks)), (dim, total.item(), ranks)
        else:
            assert topology.group_of(dim) is None


def _case(rank: int, world: int, case: str) -> dict[str, Any]:
    import torch

    from shardwise.comm import groups, mesh

    mesh.reset_layout()
    groups.clear_topology()
    if case == "pipe_then_tensor":
        mesh.ensure_layout(pp=2, source="PipelineModule(num_stages=2)")
        assert groups.get_pipeline_parallel_world_size() == 2 and groups.get_data_parallel_world_size() == 2
        topo = mesh.ensure_layout(tp=2, source="tp_model_init(tp_size=2)")
        _check_groups(topo, ("pp", "tp", "mp", "dp", "sdp", "sp"))
        assert (topo.dp_size, topo.mp_size, topo.dims.pp) == (1, 2, 2)
        assert groups.get_pipeline_parallel_rank() == rank // 2
        assert groups.get_tensor_model_parallel_rank() == rank % 2
        device_mesh = topo.device_mesh("cpu")
        assert device_mesh.mesh_dim_names == ("pp", "tp")
        assert tuple(device_mesh["tp"].mesh.tolist()) == topo.ranks_of("tp")
        try:
            mesh.ensure_layout(pp=4, source="a second PipelineModule(num_stages=4)")
        except ValueError as exc:
            assert "PipelineModule(num_stages=2) declared pp=2" in str(exc), exc
        else:
            raise AssertionError("a conflicting pp degree was accepted")
        assert mesh.ensure_layout(pp=2, source="the same again") is topo
        return {"tp": topo.ranks_of("tp"), "pp": topo.ranks_of("pp")}
    if case == "experts":
        topo = mesh.ensure_layout(ep=2, source="MoE(ep_size=2)")
        _check_groups(topo, ("ep", "edp", "dp", "sdp"))
        assert groups.get_expert_parallel_world_size() == 2
        assert groups.get_expert_data_parallel_world_size() == 2
        assert groups.get_expert_data_parallel_group() is topo.group_of("edp")
        return {"ep": topo.ranks_of("ep"), "edp": topo.ranks_of("edp")}
    if case == "initialize_reads_the_config":
        import shardwise

        model = torch.nn.Linear(4, 4)
        config = {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 1,
            "sequence_parallel_size": 2,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        }
        engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=config)
        topo = mesh.current_layout()
        assert topo is not None and groups.current_topology() is topo
        _check_groups(topo, ("sp", "dp", "sdp"))
        assert (topo.sp_size, topo.dp_size, topo.shard_size) == (2, 2, 4)
        assert engine.train_batch_size() == 2 * 1 * 2  # micro x gas x (world / sp)
        return {"sp": topo.ranks_of("sp")}
    raise AssertionError(case)


def test_declared_degrees_become_every_features_groups() -> None:
    cases = ["pipe_then_tensor", "experts", "initialize_reads_the_config"]
    results = run_distributed_cases(_case, cases, world_size=WORLD, timeout=240)
    assert results[0] == [
        {"tp": (0, 1), "pp": (0, 2)},
        {"tp": (0, 1), "pp": (1, 3)},
        {"tp": (2, 3), "pp": (0, 2)},
        {"tp": (2, 3), "pp": (1, 3)},
    ]
    assert results[1] == [
        {"ep": (0, 1), "edp": (0, 2)},
        {"ep": (0, 1), "edp": (1, 3)},
        {"ep": (2, 3), "edp": (0, 2)},
        {"ep": (2, 3), "edp": (1, 3)},
    ]
    assert [r["sp"] for r in results[2]] == [(0, 1), (0, 1), (2, 3), (2, 3)]
