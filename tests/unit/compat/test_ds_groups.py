"""deepspeed.utils.groups: the layout read from shardwise's topology; DeepSpeed's expert-rank arithmetic."""

from __future__ import annotations

import pytest

from shardwise.comm import groups as comm_groups
from shardwise.comm.parallel_dims import ParallelDims
from shardwise.comm.topology import Topology
from shardwise.compat import groups


def test_expert_parallel_ranks_e_m_d() -> None:
    expert, expert_data = groups._get_expert_parallel_ranks(16, 2, 4)
    assert expert == [[0, 2, 4, 6], [8, 10, 12, 14], [1, 3, 5, 7], [9, 11, 13, 15]]
    assert expert_data == [[0, 8], [2, 10], [4, 12], [6, 14], [1, 9], [3, 11], [5, 13], [7, 15]]


def test_expert_parallel_ranks_data_before_expert_with_pipeline() -> None:
    expert, expert_data = groups._get_expert_parallel_ranks(16, 1, 2, pipeline_parallel_size_=2,
                                                           use_data_before_expert_parallel_=True)
    assert expert == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert expert_data == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    with pytest.raises(AssertionError, match="divisible"):
        groups._get_expert_parallel_ranks(6, 4, 1)


DP_GROUP = object()  # the mpu's group, as an opaque object


class Mpu:
    """A Megatron-style mpu of a one-rank world (the unit test has no process group)."""

    def get_data_parallel_group(self) -> object:
        return DP_GROUP

    def get_data_parallel_rank(self) -> int:
        return 0

    def get_data_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_group(self) -> None:
        return None

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_world_size(self) -> int:
        return 1


@pytest.fixture
def no_registered_layout():
    comm_groups.clear_topology()
    yield
    comm_groups.clear_topology()


def test_layout_comes_from_the_one_registered_topology(no_registered_layout: None) -> None:
    assert groups._get_data_parallel_world_size() == 1 and groups._get_data_parallel_group() is None
    assert groups.get_model_parallel_world_size() == 1 and groups._get_sequence_parallel_world_size() == 1
    # the layout initialize registers (here a 2 x 4 one) is what every DeepSpeed accessor answers
    comm_groups.set_topology(
        Topology(world_rank=5, world_size=8, dp_rank=2, dp_size=4, mp_rank=1, mp_size=2,
                 shard_rank=2, shard_size=4, dims=ParallelDims(dp_shard=4, tp=2, world_size=8))
    )
    assert (groups.get_data_parallel_world_size(), groups.get_data_parallel_rank()) == (4, 2)
    assert (groups.get_model_parallel_world_size(), groups.get_model_parallel_rank()) == (2, 1)
    assert groups._get_expert_data_parallel_world_size() == 4 and groups._get_expert_parallel_world_size() == 1
    # groups.initialize(mpu=...) registers the mpu's layout for every reader of comm.groups too
    groups.initialize(ep_size=1, mpu=Mpu())
    assert groups.get_data_parallel_group() is DP_GROUP and comm_groups.get_data_parallel_group() is DP_GROUP
    assert groups.get_data_parallel_world_size() == 1


def test_expert_groups_are_declared_to_the_one_layout() -> None:
    from shardwise.comm import mesh

    mesh.reset_layout()
    try:
        groups._create_expert_and_data_parallel(1)  # size 1: the data-parallel groups serve
        assert mesh.current_layout() is None and groups._get_expert_parallel_group_dict() == {}
        # one process: ep=2 cannot tile the world; the layout says so, naming the declarer
        with pytest.raises(ValueError, match=r"ep=2 .*_create_expert_and_data_parallel"):
            groups._create_expert_and_data_parallel(2)
        with pytest.raises(ValueError, match="use_data_before_expert_parallel_"):
            groups._create_expert_and_data_parallel(2, use_data_before_expert_parallel_=True)
    finally:
        mesh.reset_layout()
