"""deepspeed.utils.groups: the layout read from shardwise's topology; DeepSpeed's expert-rank arithmetic."""

from __future__ import annotations

import pytest

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


class Mpu:
    def get_data_parallel_group(self) -> None:
        return None

    def get_data_parallel_rank(self) -> int:
        return 1

    def get_data_parallel_world_size(self) -> int:
        return 2

    def get_model_parallel_group(self) -> None:
        return None

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_world_size(self) -> int:
        return 1


def test_layout_comes_from_the_topology(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(groups, "_MPU", None)
    assert groups._get_data_parallel_world_size() == 1 and groups._get_data_parallel_group() is None
    assert groups.get_model_parallel_world_size() == 1 and groups._get_sequence_parallel_world_size() == 1
    groups.initialize(ep_size=1, mpu=Mpu())
    assert (groups.get_data_parallel_world_size(), groups.get_data_parallel_rank()) == (2, 1)
    assert groups._get_expert_data_parallel_world_size() == 2 and groups._get_expert_parallel_world_size() == 1


def test_expert_groups_need_moe() -> None:
    groups._create_expert_and_data_parallel(1)
    with pytest.raises(NotImplementedError, match=r"expert parallel size 2.*MoE"):
        groups._create_expert_and_data_parallel(2)
