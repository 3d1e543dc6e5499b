"""Partition maths: packing, buckets, shards (pure, no process group)."""

from __future__ import annotations

import itertools

import pytest

from shardwise.zero.partition import plan_layout


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("bucket", [1, 5, 16, 1000])
def test_every_element_belongs_to_exactly_one_rank_and_params_do_not_overlap(world, bucket):
    numels = [7, 1, 13, 4, 30, 2]
    layout = plan_layout(numels, world, bucket)
    owner = [None] * layout.total_numel
    for rank in range(world):
        for lo, hi in layout.owned_ranges(rank):
            for i in range(lo, hi):
                assert owner[i] is None
                owner[i] = rank
    assert None not in owner
    covered = sorted((s.offset, s.offset + s.numel) for s in layout.slots)
    for (_a0, a1), (b0, _b1) in itertools.pairwise(covered):
        assert a1 <= b0
    for slot in layout.slots:
        plan = layout.buckets[slot.bucket]
        assert plan.start <= slot.offset and slot.offset + slot.numel <= plan.end
    for plan in layout.buckets:
        assert plan.numel % world == 0
    assert layout.partition_numel * world == layout.total_numel


def test_params_are_packed_in_reverse_order_and_large_params_get_their_own_bucket():
    layout = plan_layout([3, 100, 4, 5], world_size=2, bucket_numel=10)
    assert [b.param_indices for b in layout.buckets] == [(3, 2), (1,), (0,)]
    assert [(b.start, b.end) for b in layout.buckets] == [(0, 10), (10, 110), (110, 114)]


def test_padding_is_at_most_world_times_align_minus_one_per_bucket():
    layout = plan_layout([5, 5, 5], world_size=4, bucket_numel=5, align=2)
    for plan in layout.buckets:
        assert plan.numel % 8 == 0 and plan.numel - 5 < 8


def test_param_shard_overlap():
    layout = plan_layout([6], world_size=2, bucket_numel=100)
    assert layout.param_shard_overlap(0, 0) == (0, 3)
    assert layout.param_shard_overlap(0, 1) == (3, 6)
    padded = plan_layout([3], world_size=4, bucket_numel=100)
    assert padded.param_shard_overlap(0, 3) is None


@pytest.mark.parametrize("bad", [dict(world_size=0), dict(bucket_numel=0), dict(align=0)])
def test_invalid_arguments(bad):
    args = dict(numels=[1], world_size=1, bucket_numel=1, align=1) | bad
    with pytest.raises(ValueError):
        plan_layout(**args)


def test_empty_parameter_is_rejected():
    with pytest.raises(ValueError, match="parameter 1 has 0 elements"):
        plan_layout([3, 0], 2, 10)
