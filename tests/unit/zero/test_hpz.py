"""ZeRO++ hpZ groups (pure): consecutive runs of the partition size, for world sizes 2-8."""

from __future__ import annotations

import pytest

from shardwise.config import load_config
from shardwise.zero.hpz import hpz_active, hpz_group_of, hpz_groups


@pytest.mark.parametrize("world", range(2, 9))
@pytest.mark.parametrize("size", range(0, 10))
def test_groups_for_every_world_size(world: int, size: int) -> None:
    groups = hpz_groups(world, size)
    active = 1 < size < world and world % size == 0
    assert hpz_active(size, world) == active == bool(groups)
    if not active:
        assert all(hpz_group_of(r, world, size) == list(range(world)) for r in range(world))
        return
    # a partition of the ranks into world/size runs of `size` consecutive ranks (FSDP2's mesh rows)
    assert len(groups) == world // size and all(len(g) == size for g in groups)
    assert sorted(r for g in groups for r in g) == list(range(world))
    for g in groups:
        assert g == list(range(g[0], g[0] + size)) and g[0] % size == 0
    for rank in range(world):
        assert rank in hpz_group_of(rank, world, size) and len(hpz_group_of(rank, world, size)) == size


def test_examples() -> None:
    assert hpz_groups(4, 2) == [[0, 1], [2, 3]]
    assert hpz_groups(8, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert hpz_groups(6, 3) == [[0, 1, 2], [3, 4, 5]]
    assert hpz_groups(6, 4) == [] and hpz_groups(4, 4) == []


@pytest.mark.parametrize("world", range(2, 9))
@pytest.mark.parametrize("size", range(2, 9))
def test_the_config_warning_agrees_with_the_groups(world: int, size: int) -> None:
    cfg = load_config(
        {
            "train_micro_batch_size_per_gpu": 1,
            "zero_optimization": {"stage": 3, "zero_hpz_partition_size": size},
        },
        world_size=world,
    )
    warned = [s.path for s in cfg.ignored] == ["zero_optimization.zero_hpz_partition_size"]
    assert warned == (not hpz_active(size, world))
