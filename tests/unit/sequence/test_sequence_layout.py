"""Pure arithmetic of the Ulysses layouts (shardwise.sequence.layout)."""

from __future__ import annotations

import pytest

from shardwise.sequence.layout import (
    get_shard_size_list,
    head_shard_sizes,
    padded_length,
    sequence_dim,
    shard_bounds,
)


@pytest.mark.parametrize(
    ("heads", "world", "kv", "expected"),
    [
        (8, 2, None, [4, 4]),
        (7, 2, None, [4, 3]),  # uneven: the first ranks take one more
        (7, 4, None, [2, 2, 2, 1]),
        (8, 2, 2, [4, 4]),  # grouped-query: 4 query heads per kv head stay together
        (12, 4, 6, [4, 4, 2, 2]),  # 6 kv groups of 2 over 4 ranks: 2, 2, 1, 1 groups
    ],
)
def test_head_shard_sizes(heads: int, world: int, kv: int | None, expected: list[int]) -> None:
    sizes = head_shard_sizes(heads, world, kv)
    assert sizes == expected and sum(sizes) == heads


def test_head_shard_sizes_refuses_fewer_kv_heads_than_ranks() -> None:
    with pytest.raises(
        ValueError, match="2 key/value heads cannot be split over a sequence-parallel group of 4"
    ):
        head_shard_sizes(8, 4, 2)
    with pytest.raises(ValueError, match="not a multiple of num_kv_heads=3"):
        head_shard_sizes(8, 2, 3)


def test_sequence_dim_and_bounds() -> None:
    assert (sequence_dim(0), sequence_dim(1)) == (1, 0)
    with pytest.raises(ValueError, match="batch_dim_idx=2"):
        sequence_dim(2)
    assert [shard_bounds(12, 3, r) for r in range(3)] == [(0, 4), (4, 8), (8, 12)]
    with pytest.raises(ValueError, match="pad it to 12"):
        shard_bounds(10, 4, 0)
    assert (padded_length(10, 4), padded_length(12, 4)) == (12, 12)


class _Meta:
    def __init__(self, num_kv_heads: int | None = None, tp_grain_size: int = 1) -> None:
        self.num_kv_heads, self.tp_grain_size = num_kv_heads, tp_grain_size


def test_get_shard_size_list_follows_deepspeed() -> None:
    assert get_shard_size_list(7, 2) == [4, 3]
    assert get_shard_size_list(96, 3, _Meta(num_kv_heads=6)) == [32, 32, 32]
    assert get_shard_size_list(80, 3, _Meta(num_kv_heads=5)) == [32, 32, 16]  # kv groups: 2, 2, 1
    assert get_shard_size_list(80, 3, _Meta(num_kv_heads=5), name="mlp.up_proj") == [27, 27, 26]
    assert get_shard_size_list(100, 3, _Meta(tp_grain_size=32)) == [32, 32, 36]  # the last takes the rest
