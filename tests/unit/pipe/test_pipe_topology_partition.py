"""DeepSpeed's process topologies and layer partitioning, as pure arithmetic.

Expected partitions were computed with DeepSpeed 0.19.8's ``partition_balanced`` (the recurrence is
the same, so every rank cuts the layers as a DeepSpeed run would).
"""

from __future__ import annotations

import pytest

from shardwise.pipe.grid import default_topology
from shardwise.pipe.partition import partition_balanced, partition_uniform, type_weights
from shardwise.pipe.topology import (
    PipeDataParallelTopology,
    PipeModelDataParallelTopology,
    ProcessTopology,
    _prime_factors,
)


def test_rank_and_coordinate_round_trip_row_major() -> None:
    topo = ProcessTopology(axes=["a", "b", "c"], dims=[2, 3, 4])
    assert topo.world_size() == 24
    for rank in range(24):
        coord = topo.get_coord(rank)
        assert topo.get_rank(**coord._asdict()) == rank
    assert topo.get_rank(a=1, b=0, c=0) == 12 and topo.get_rank(a=0, b=1, c=0) == 4
    assert topo.mapping[topo.ProcessCoord(a=0, b=0, c=3)] == 3
    with pytest.raises(ValueError, match="slices"):
        topo.get_rank(a=0)
    with pytest.raises(ValueError, match="rank 24 not found"):
        topo.get_coord(24)


def test_comm_lists_filters_and_repr() -> None:
    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)
    assert topo.get_axis_names() == ["pipe", "data", "model"]
    assert topo.get_axis_comm_lists("pipe") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert topo.get_axis_comm_lists("model") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topo.get_axis_comm_lists("nope") == []
    assert topo.filter_match(pipe=0, data=1) == [2, 3]
    assert topo.get_axis_list("data", 0) == [0, 1, 4, 5]
    assert topo.get_rank_repr(rank=3) == "model_01"
    assert topo.get_rank_repr(rank=3, omit_axes=[]) == "pipe_00-data_01-model_01"
    assert topo.get_dim("pipe") == 2 and topo.get_dim("nope") == 0
    pd = PipeDataParallelTopology(num_pp=2, num_dp=3)
    assert pd.get_axis_comm_lists("data") == [[0, 1, 2], [3, 4, 5]]


def test_prime_factors_and_default_split() -> None:
    assert _prime_factors(1) == [] and _prime_factors(12) == [2, 2, 3] and _prime_factors(7) == [7]
    with pytest.raises(ValueError):
        _prime_factors(0)
    topo = default_topology(12)  # primes 2, 2, 3 alternate: pipe 2*3, data 2
    assert (topo.get_dim("pipe"), topo.get_dim("data")) == (6, 2)
    assert (default_topology(1).get_dim("pipe"), default_topology(1).get_dim("data")) == (1, 1)


@pytest.mark.parametrize(
    ("items", "parts", "expected"),
    [(5, 2, [0, 3, 5]), (8, 3, [0, 3, 6, 8]), (2, 4, [0, 1, 2, 2, 2]), (9, 3, [0, 3, 6, 9])],
)
def test_uniform(items: int, parts: int, expected: list[int]) -> None:
    assert partition_uniform(items, parts) == expected


@pytest.mark.parametrize(
    ("weights", "parts", "expected"),
    [
        ([1, 1, 1, 4], 2, [0, 3, 4]),
        ([0, 2048, 4160, 4160, 4160, 4160, 64, 0], 2, [0, 4, 8]),
        ([5, 5, 5, 5, 5, 5], 3, [0, 2, 4, 6]),
        ([100, 0, 0, 1, 1, 100], 2, [0, 4, 6]),
        ([1, 2], 3, [0, 1, 2, 2]),
    ],
)
def test_balanced_matches_deepspeed(weights: list[int], parts: int, expected: list[int]) -> None:
    assert partition_balanced(weights, parts) == expected


def test_type_weights() -> None:
    assert type_weights(["Embedding", "Block", "block", None, "LayerNorm"], "block") == [0, 1, 1, 0, 0]
    with pytest.raises(RuntimeError, match="Partitioning 'type:attn' found no valid layers"):
        type_weights(["Block"], "attn")
