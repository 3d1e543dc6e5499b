"""ParallelDims: the named degrees of the layout, their validation and hpZ's runs."""

from __future__ import annotations

import pytest

from shardwise.comm.parallel_dims import MESH_ORDER, ParallelDims


def test_data_parallel_only_layout() -> None:
    dims = ParallelDims(dp_shard=4, world_size=4)
    assert (dims.dp, dims.shard_degree) == (4, 4)
    assert dims.mesh_dims() == (("dp_shard", 4),)
    assert [name for name in MESH_ORDER if dims.enabled(name)] == ["dp_shard"]
    assert not dims.enabled("ep")


def test_every_dimension_in_mesh_order() -> None:
    dims = ParallelDims(dp_replicate=2, dp_shard=2, tp=2, pp=2, sp=2, ep=4, world_size=32)
    assert dims.mesh_dims() == (("pp", 2), ("dp_replicate", 2), ("dp_shard", 2), ("sp", 2), ("tp", 2))
    assert (dims.dp, dims.shard_degree) == (4, 4)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"dp_shard": 2, "world_size": 4}, "multiply to the world size"),
        ({"dp_shard": 2, "tp": 2, "world_size": 2}, "= 4, but the world has 2"),
        ({"dp_shard": 0, "world_size": 0}, "dp_shard=0"),
        ({"dp_shard": 2, "ep": 3, "world_size": 2}, "ep=3 must divide"),
        ({"dp_shard": True, "world_size": 1}, "dp_shard=True"),
    ],
)
def test_bad_degrees_name_the_rule(kwargs: dict[str, int], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        ParallelDims(**kwargs)


def test_unknown_dimension_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown parallel dimension 'cp'"):
        ParallelDims().enabled("cp")


@pytest.mark.parametrize(
    ("world", "size", "runs"),
    [
        (8, 4, [[0, 1, 2, 3], [4, 5, 6, 7]]),
        (4, 2, [[0, 1], [2, 3]]),
        (6, 4, []),
        (4, 4, []),
        (8, 1, []),
        (8, 0, []),
    ],
)
def test_dp_shard_runs(world: int, size: int, runs: list[list[int]]) -> None:
    assert ParallelDims(dp_shard=world, world_size=world).dp_shard_runs(size) == runs


def test_rank_groups_follow_deepspeeds_pipe_data_model_order() -> None:
    dims = ParallelDims(pp=2, dp_shard=2, tp=2, world_size=8)
    assert dims.rank_groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dims.rank_groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.rank_groups("tp") == dims.rank_groups("mp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.size_of("sdp") == 2


def test_rank_groups_tile_the_world_for_every_dimension() -> None:
    dims = ParallelDims(pp=2, dp_shard=2, sp=2, tp=1, ep=2, world_size=8)
    for dim in ("pp", "dp_replicate", "dp_shard", "sp", "tp", "dp", "sdp", "mp", "ep", "edp"):
        flat = sorted(r for g in dims.rank_groups(dim) for r in g)
        assert flat == list(range(8)), dim


def test_expert_groups_cut_the_sequence_data_groups_as_deepspeed_does() -> None:
    dims = ParallelDims(dp_shard=2, sp=2, ep=2, world_size=4)
    assert dims.rank_groups("sdp") == [[0, 1, 2, 3]]
    assert dims.rank_groups("ep") == [[0, 1], [2, 3]]
    assert dims.rank_groups("edp") == [[0, 2], [1, 3]]
    # with tensor parallelism the expert runs stride over the tp ranks (DeepSpeed's E/M/D layout)
    tp_dims = ParallelDims(dp_shard=8, tp=2, ep=4, world_size=16)
    assert sorted(map(sorted, tp_dims.rank_groups("ep"))) == [
        [0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]
    ]


def test_rank_groups_unknown_dimension() -> None:
    with pytest.raises(ValueError, match="unknown parallel dimension 'xp'"):
        ParallelDims().rank_groups("xp")
