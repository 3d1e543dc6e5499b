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
