"""comm.groups: the utils.groups-style accessors read the one registered Topology."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from shardwise.comm import groups
from shardwise.comm.parallel_dims import ParallelDims
from shardwise.comm.topology import Topology


@pytest.fixture(autouse=True)
def _no_registered_layout() -> Iterator[None]:
    groups.clear_topology()
    yield
    groups.clear_topology()


def test_without_a_registered_layout_the_world_is_data_parallel() -> None:
    assert groups.current_topology() == Topology()
    assert (groups.get_data_parallel_world_size(), groups.get_data_parallel_rank()) == (1, 0)
    assert groups.get_data_parallel_group() is None
    assert groups.get_pipeline_parallel_world_size() == 1
    assert groups.get_expert_parallel_world_size() == 1


def test_accessors_read_the_registered_layout() -> None:
    dp, mp, shard = object(), object(), object()
    topo = Topology(
        world_rank=5,
        world_size=8,
        dp_group=dp,  # type: ignore[arg-type]
        dp_rank=2,
        dp_size=4,
        mp_group=mp,  # type: ignore[arg-type]
        mp_rank=1,
        mp_size=2,
        shard_group=shard,  # type: ignore[arg-type]
        shard_rank=2,
        shard_size=4,
        dims=ParallelDims(dp_shard=4, tp=2, world_size=8),
    )
    groups.set_topology(topo)
    assert groups.current_topology() is topo
    assert (
        groups.get_data_parallel_group(),
        groups.get_data_parallel_world_size(),
        groups.get_data_parallel_rank(),
    ) == (
        dp,
        4,
        2,
    )
    assert (groups.get_model_parallel_group(), groups.get_model_parallel_world_size()) == (mp, 2)
    assert groups.get_tensor_model_parallel_rank() == 1
    assert (groups.get_sequence_data_parallel_group(), groups.get_sequence_data_parallel_world_size()) == (
        shard,
        4,
    )
    assert (groups.get_sequence_parallel_world_size(), groups.get_sequence_parallel_group()) == (1, None)
    assert (groups.get_expert_data_parallel_group(), groups.get_expert_data_parallel_world_size()) == (dp, 4)
    assert groups.get_expert_data_parallel_rank() == 2
    assert (groups.get_pipeline_parallel_world_size(), groups.get_pipeline_parallel_rank()) == (1, 0)


def test_expert_data_parallel_refuses_an_expert_dimension_without_groups() -> None:
    groups.set_topology(
        Topology(world_size=2, dp_size=2, shard_size=2, dims=ParallelDims(dp_shard=2, ep=2, world_size=2))
    )
    with pytest.raises(ValueError, match="expert-parallel degree 2"):
        groups.get_expert_data_parallel_group()


def test_topology_checks_its_dims_against_its_sizes() -> None:
    with pytest.raises(AssertionError):
        Topology(world_size=2, dp_size=2, dp_rank=1, shard_size=2)  # dims left at a world of one


def test_mesh_layout_of_one_rank_and_its_refusals() -> None:
    from shardwise.comm import mesh

    mesh.reset_layout()
    try:
        topo = mesh.ensure_layout(source="a test")
        assert groups.current_topology() is topo and mesh.current_layout() is topo
        assert [topo.size_of(d) for d in ("pp", "tp", "sp", "ep", "edp", "sdp")] == [1] * 6
        with pytest.raises(ValueError, match=r"pp=2 \(PipelineModule\).*does not divide the world size 1"):
            mesh.ensure_layout(pp=2, source="PipelineModule")
        assert mesh.declared_degrees() == {}  # a layout that does not tile the world is not kept
        with pytest.raises(ValueError, match="tp degree 0 must be an int >= 1"):
            mesh.ensure_layout(tp=0, source="tp_model_init")
        mesh.ensure_layout(sp=1, source="the config")
        with pytest.raises(ValueError, match="the config declared sp=1"):
            mesh.ensure_layout(sp=2, source="UlyssesSPAttentionHF")
        with pytest.raises(ValueError, match="unknown parallel dimension 'xp'"):
            topo.size_of("xp")
    finally:
        mesh.reset_layout()
