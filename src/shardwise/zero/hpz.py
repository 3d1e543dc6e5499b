"""ZeRO++ hpZ: the secondary partition groups (pure).

With ``zero_hpz_partition_size: k`` at stage 3 (``1 < k < W``, ``W % k == 0``), every unit
keeps, after its forward, a second copy of the weights sharded over a group of ``k`` ranks
only, so the backward all-gather runs inside that group (within a node, when the ``k``
ranks of a node are consecutive, as launchers number them) instead of over all ``W``. On
FSDP2 that is ``reshard_after_forward=k``, which reshards onto the rows of the data-parallel
mesh viewed as ``(W / k, k)``: the groups are the runs of ``k`` consecutive ranks, which is
what :func:`hpz_groups` returns: the topology's ``dp_shard`` dimension cut into runs
(:meth:`shardwise.comm.parallel_dims.ParallelDims.dp_shard_runs`), so the groups are defined
where the rest of the layout is. Sizes that do not divide ``W`` (or are ``>= W``) leave hpZ
off, and ``config.inert`` says so at start-up.
"""

from __future__ import annotations

from shardwise.comm.parallel_dims import ParallelDims


def hpz_active(partition_size: int, world_size: int) -> bool:
    """Whether a secondary partition of ``partition_size`` ranks is used for ``world_size`` ranks.

    Example:
        >>> hpz_active(2, 4), hpz_active(3, 4), hpz_active(4, 4), hpz_active(1, 8)
        (True, False, False, False)
    """
    return bool(_runs(world_size, partition_size))


def _runs(world_size: int, partition_size: int) -> list[list[int]]:
    return ParallelDims(dp_shard=world_size, world_size=world_size).dp_shard_runs(partition_size)


def hpz_groups(world_size: int, partition_size: int) -> list[list[int]]:
    """The secondary-partition groups (data-parallel ranks), or ``[]`` when hpZ is off.

    Example:
        >>> hpz_groups(8, 4)
        [[0, 1, 2, 3], [4, 5, 6, 7]]
        >>> hpz_groups(6, 4)
        []
    """
    return _runs(world_size, partition_size)


def hpz_group_of(rank: int, world_size: int, partition_size: int) -> list[int]:
    """The ranks ``rank`` gathers from in backward: its hpZ group, or every rank when hpZ is off."""
    for group in hpz_groups(world_size, partition_size):
        if rank in group:
            return group
    return list(range(world_size))
