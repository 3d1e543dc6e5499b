"""Launch order of gradient reductions (pure: no torch, no process group)."""

from __future__ import annotations

import itertools
import logging
import random

import pytest

from shardwise.utils.logging import get_logger
from shardwise.zero.launch_order import CHUNK_NUMEL, LaunchOrder, Unit, plan_units
from shardwise.zero.partition import plan_layout


def _layout(numels: list[int], world: int = 2, bucket: int = 1000):
    return plan_layout(numels, world, bucket)


# ---------------------------------------------------------------------- planning
def test_whole_buckets_without_pieces():
    layouts = [_layout([6, 4, 3], bucket=8), _layout([5])]
    units = plan_units(layouts, pieces=False, chunk_numel=1)
    assert [(u.group, u.bucket, u.start, u.end, u.params) for u in units] == [
        (0, 0, 0, 8, (2, 1)),
        (0, 1, 8, 14, (0,)),
        (1, 0, 0, 6, (0,)),
    ]


def test_pieces_cut_at_the_first_parameter_boundary_past_the_chunk_size():
    # reverse registration order: offsets 0 (p4, 3), 3 (p3, 3), 6 (p2, 5), 11 (p1, 2), 13 (p0, 4); padded to 18
    layout = _layout([4, 2, 5, 3, 3], world=2)
    units = plan_units([layout], pieces=True, chunk_numel=6)
    assert [(u.start, u.end, u.params) for u in units] == [(0, 6, (4, 3)), (6, 13, (2, 1)), (13, 18, (0,))]


def test_the_last_piece_takes_the_padding_and_is_never_cut_after_the_last_parameter():
    layout = _layout([7], world=4)  # one bucket of 8 (1 padding element)
    units = plan_units([layout], pieces=True, chunk_numel=1)
    assert [(u.start, u.end, u.params) for u in units] == [(0, 8, (0,))]


@pytest.mark.parametrize("chunk", [1, 3, 8, 50, 10**9])
@pytest.mark.parametrize("bucket", [4, 16, 1000])
def test_pieces_tile_every_bucket_and_hold_every_parameter_once(chunk, bucket):
    numels = [7, 1, 13, 4, 30, 2, 9]
    layouts = [_layout(numels, world=3, bucket=bucket), _layout([5, 5], world=3, bucket=bucket)]
    units = plan_units(layouts, pieces=True, chunk_numel=chunk)
    for gi, layout in enumerate(layouts):
        mine = [u for u in units if u.group == gi]
        assert sorted(p for u in mine for p in u.params) == list(range(len(layout.slots)))
        for b, plan in enumerate(layout.buckets):
            pieces = [u for u in mine if u.bucket == b]
            assert pieces[0].start == plan.start and pieces[-1].end == plan.end
            for before, after in itertools.pairwise(pieces):
                assert before.end == after.start
                assert before.end - before.start >= chunk  # only the last piece may be small
            for u in pieces:
                slots = [layout.slots[p] for p in u.params]
                assert all(u.start <= s.offset and s.offset + s.numel <= u.end for s in slots)
                assert [s.offset for s in slots] == sorted(s.offset for s in slots)
    # units keep the groups and buckets in order
    keys = [(u.group, u.bucket, u.start) for u in units]
    assert keys == sorted(keys)


def test_default_chunk_is_ddps_25_mib_of_fp32():
    assert CHUNK_NUMEL == 25 * 2**20 // 4
    reaches = _layout([1, CHUNK_NUMEL], world=1, bucket=10 * CHUNK_NUMEL)
    assert [u.params for u in plan_units([reaches], pieces=True)] == [(1,), (0,)]
    short = _layout([1, CHUNK_NUMEL - 1], world=1, bucket=10 * CHUNK_NUMEL)
    assert [u.params for u in plan_units([short], pieces=True)] == [(1, 0)]


# ---------------------------------------------------------------------- arrivals
def _units(n: int) -> list[Unit]:
    """n single-parameter units in one bucket: unit k holds parameter k."""
    return [Unit(0, 0, k, k + 1, (k,)) for k in range(n)]


def _learned(units: list[Unit], launch_while_backward: bool = True) -> LaunchOrder:
    """An order after a first, observing backward in which every parameter arrived once."""
    order = LaunchOrder(units, launch_while_backward=launch_while_backward)
    for u in units:
        for p in u.params:
            assert order.arrive(u.group, p, reducing=True) == []  # the first backward only observes
    assert order.take_remaining() == list(range(len(units)))
    order.end_backward(reducing=True)
    return order


def test_the_first_backward_only_observes_then_units_launch_as_they_complete():
    order = _learned(_units(3))
    assert order.early
    assert order.arrive(0, 0, reducing=True) == [0]
    assert order.arrive(0, 1, reducing=True) == [1]
    assert order.take_remaining() == [2]
    order.end_backward(reducing=True)


@pytest.mark.parametrize("seed", range(20))
def test_out_of_order_arrivals_never_launch_a_unit_before_an_earlier_one(seed):
    units = [
        Unit(0, 0, 0, 4, (0, 1)),
        Unit(0, 0, 4, 8, (2,)),
        Unit(0, 1, 8, 12, (3, 4)),
        Unit(1, 0, 0, 4, (0,)),
    ]
    order = _learned(units)
    arrivals = [(u.group, p) for u in units for p in u.params]
    rng = random.Random(seed)
    rng.shuffle(arrivals)
    skipped = arrivals.pop() if seed % 2 else None  # a parameter this rank does not use
    launched: list[int] = []
    arrived: set[tuple[int, int]] = set()
    for group, param in arrivals:
        arrived.add((group, param))
        ready = order.arrive(group, param, reducing=True)
        for k in ready:
            assert all((units[j].group, p) in arrived for j in range(k + 1) for p in units[j].params)
        launched.extend(ready)
    if skipped is not None:  # nothing from its unit on goes before backward ends
        k = order.unit_of(*skipped)
        assert order.missing(k) == 1 and launched == list(range(k))
    launched.extend(order.take_remaining())
    assert launched == list(range(len(units)))
    order.end_backward(reducing=True)


def test_nothing_launches_early_without_pieces_or_overlap():
    order = _learned(_units(2), launch_while_backward=False)
    assert order.arrive(0, 0, reducing=True) == [] and order.arrive(0, 1, reducing=True) == []
    assert order.take_remaining() == [0, 1]


def test_backwards_that_are_not_reduced_count_nothing_and_launch_nothing():
    order = _learned(_units(2))
    assert order.arrive(0, 1, reducing=False) == [] and order.arrive(0, 0, reducing=False) == []
    assert order.missing(0) == 1 and order.missing(1) == 1
    order.end_backward(reducing=False)
    assert not order.backward_seen
    assert order.arrive(0, 0, reducing=True) == [0]


def test_counts_reset_between_backwards():
    order = _learned(_units(2))
    assert order.arrive(0, 0, reducing=True) == [0]
    assert order.take_remaining() == [1]  # parameter 1 got no gradient: its unit still goes
    assert order.missing(1) == 1 and order.next_unit == 2
    order.end_backward(reducing=True)
    assert order.next_unit == 0 and order.missing(0) == 1 and order.missing(1) == 1
    assert not order.backward_seen and order.take_remaining() == []
    assert order.arrive(0, 1, reducing=True) == []  # waits for unit 0 again
    assert order.arrive(0, 0, reducing=True) == [0, 1]


def test_bucket_ends():
    units = [Unit(0, 0, 0, 2, (0,)), Unit(0, 0, 2, 4, (1,)), Unit(0, 1, 4, 6, (2,)), Unit(1, 0, 0, 2, (0,))]
    order = LaunchOrder(units, launch_while_backward=True)
    assert [order.ends_bucket(k) for k in range(4)] == [False, True, True, True]


# ---------------------------------------------------------------------- repeated gradients
def test_repeats_in_the_first_backward_keep_launching_after_backward():
    order = LaunchOrder(_units(2), launch_while_backward=True)
    order.arrive(0, 0, reducing=True)
    order.arrive(0, 0, reducing=True)  # reentrant checkpointing: a second gradient
    order.arrive(0, 1, reducing=True)
    assert order.take_remaining() == [0, 1]
    order.end_backward(reducing=True)
    assert order.learned and not order.early
    for _ in range(2):  # later backwards, even without repeats, never launch early
        assert order.arrive(0, 0, reducing=True) == [] and order.arrive(0, 1, reducing=True) == []
        assert order.take_remaining() == [0, 1]
        order.end_backward(reducing=True)


def test_a_repeat_before_its_unit_launched_turns_early_launching_off_with_a_warning(caplog):
    order = _learned(_units(3))
    assert order.arrive(0, 1, reducing=True) == []
    get_logger().addHandler(caplog.handler)  # the library logger does not propagate
    try:
        assert order.arrive(0, 1, reducing=True) == []
    finally:
        get_logger().removeHandler(caplog.handler)
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "more than one gradient per backward" in caplog.text
    assert not order.early
    assert order.arrive(0, 0, reducing=True) == []  # complete, but now waits for the end of backward
    assert order.take_remaining() == [0, 1, 2]
    order.end_backward(reducing=True)
    assert not order.early


def test_a_repeat_after_its_unit_launched_is_an_error_naming_the_parameter():
    order = LaunchOrder(_units(2), launch_while_backward=True, label=lambda g, p: f"weight {g}.{p}")
    for p in (0, 1):
        order.arrive(0, p, reducing=True)
    order.take_remaining()
    order.end_backward(reducing=True)
    assert order.arrive(0, 0, reducing=True) == [0]
    with pytest.raises(RuntimeError, match=r"weight 0\.0 received a second gradient.*use_reentrant=False"):
        order.arrive(0, 0, reducing=True)


def test_a_repeat_in_a_backward_that_is_not_reduced_turns_early_launching_off_too():
    order = _learned(_units(2))
    order.arrive(0, 0, reducing=False)
    order.arrive(0, 0, reducing=False)
    order.end_backward(reducing=False)
    assert not order.early
    assert order.arrive(0, 0, reducing=True) == [] and order.arrive(0, 1, reducing=True) == []
