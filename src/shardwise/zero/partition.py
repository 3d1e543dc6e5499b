"""Pure partition maths for ZeRO stages 0-2: how parameters pack into a flat buffer,
how the buffer splits into buckets, and which slice of each bucket a rank owns.

Layout (one flat buffer per parameter group and dtype)::

    | bucket 0 ............................ | bucket 1 ............ | ...
    | rank0 shard | rank1 shard | ...       | r0 | r1 | ...         |
      params packed back to back, each param inside one bucket, padding at bucket ends

Every bucket is padded to a multiple of ``world_size * align`` so it splits into equal
shards. A rank's partition is the union of its shard of every bucket. Buckets are both
the unit of gradient reduction (reduce-scatter of a bucket gives every rank its shard)
and of the parameter all-gather after the step, so neither needs any re-layout.

Parameters are packed in reverse registration order: backward produces gradients
roughly in that order, so the first bucket fills first and its reduction can overlap
the rest of backward.

No torch here: the functions take sizes and return plans, and are tested in
milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Slot:
    """Where one parameter lives: its position in the flat buffer and its bucket."""

    param_index: int
    numel: int
    offset: int
    bucket: int


@dataclass(frozen=True)
class BucketPlan:
    """A contiguous, padded range of the flat buffer split into ``world_size`` shards."""

    index: int
    start: int
    end: int
    world_size: int
    param_indices: tuple[int, ...]

    @property
    def numel(self) -> int:
        """Padded size of the bucket."""
        return self.end - self.start

    @property
    def shard_numel(self) -> int:
        """Elements each rank owns in this bucket."""
        return self.numel // self.world_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        """``[start, end)`` of ``rank``'s shard in flat-buffer coordinates."""
        lo = self.start + rank * self.shard_numel
        return lo, lo + self.shard_numel


@dataclass(frozen=True)
class FlatLayout:
    """The full plan for one flat buffer."""

    slots: tuple[Slot, ...]
    buckets: tuple[BucketPlan, ...]
    total_numel: int
    world_size: int

    @property
    def partition_numel(self) -> int:
        """Elements a rank owns over all buckets."""
        return sum(b.shard_numel for b in self.buckets)

    def owned_ranges(self, rank: int) -> list[tuple[int, int]]:
        """``rank``'s shard range in every bucket."""
        return [b.shard_range(rank) for b in self.buckets]

    def param_shard_overlap(self, param_index: int, rank: int) -> tuple[int, int] | None:
        """The part of a parameter (in its own flattened coordinates) that ``rank`` owns."""
        slot = next(s for s in self.slots if s.param_index == param_index)
        lo, hi = self.buckets[slot.bucket].shard_range(rank)
        start, end = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
        if start >= end:
            return None
        return start - slot.offset, end - slot.offset


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def plan_layout(numels: list[int], world_size: int, bucket_numel: int, align: int = 1) -> FlatLayout:
    """Pack parameters (given by element count, in registration order) into buckets.

    Args:
        numels: element count of each parameter, in ``model.parameters()`` order.
        world_size: number of ranks sharing the buffer.
        bucket_numel: target bucket size in elements (``reduce_bucket_size``); a parameter
            larger than this gets a bucket of its own.
        align: every shard size is a multiple of this many elements (e.g. 16-byte alignment).

    Example:
        >>> layout = plan_layout([6, 4, 3], world_size=2, bucket_numel=8)
        >>> [(b.start, b.end, b.param_indices) for b in layout.buckets]
        [(0, 8, (2, 1)), (8, 14, (0,))]
    """
    if world_size < 1 or bucket_numel < 1 or align < 1:
        raise ValueError(
            f"world_size, bucket_numel and align must be >= 1, got {world_size}, {bucket_numel}, {align}"
        )
    quantum = world_size * align
    slots: list[Slot] = []
    buckets: list[BucketPlan] = []
    members: list[int] = []
    bucket_start = offset = 0

    def close_bucket() -> None:
        nonlocal bucket_start, offset, members
        end = bucket_start + _round_up(max(offset - bucket_start, 1), quantum)
        buckets.append(BucketPlan(len(buckets), bucket_start, end, world_size, tuple(members)))
        bucket_start = offset = end
        members = []

    for index in reversed(range(len(numels))):
        numel = numels[index]
        if numel <= 0:
            raise ValueError(f"parameter {index} has {numel} elements; empty parameters cannot be flattened")
        if members and offset - bucket_start + numel > bucket_numel:
            close_bucket()
        slots.append(Slot(index, numel, offset, len(buckets)))
        members.append(index)
        offset += numel
    if members:
        close_bucket()
    slots.sort(key=lambda s: s.param_index)
    return FlatLayout(tuple(slots), tuple(buckets), bucket_start, world_size)
