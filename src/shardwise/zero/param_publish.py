"""Stages 1-2: how updated shards reach every rank after the step (``allgather_bucket_size``,
``allgather_partitions`` / ``disable_allgather``).

By default each bucket is gathered by the parameter buffer's transport
(:meth:`~shardwise.comm.flat_buffers.FlatBuffer.gather`): over gloo one all-gather per bucket, or
with ``allgather_bucket_size`` smaller than a bucket several all-gathers of at most that many
elements each (every rank contributes the same piece of its shard, gathered into a scratch buffer
and copied to the owners' places); on one host a copy of the other ranks' shards from their
buffers, in the same pieces. With ``allgather_partitions: false``
(or the top-level ``disable_allgather: true``) each rank's shard is broadcast from its owner
instead, one broadcast per rank and bucket, as DeepSpeed does. With ``zero_quantized_weights``
(ZeRO++ qwZ) each bucket is one int8 block-quantized all-gather
(:func:`shardwise.comm.quantized_collectives.quantized_all_gather`): every rank's parameters,
its own shard included, are then the dequantized values (error <= block absmax / 254), while the
fp32 masters stay exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shardwise.comm import collectives
from shardwise.comm.flat_buffers import Pending
from shardwise.comm.group_type import Group
from shardwise.comm.init import get_global_rank
from shardwise.comm.quantized_collectives import quantized_all_gather
from shardwise.zero.flat_group import FlatGroup


@dataclass(frozen=True)
class PublishPolicy:
    """How the updated shards travel.

    Attributes:
        bucket_numel: at most this many elements per all-gather (``allgather_bucket_size``).
        broadcast: broadcast each shard from its owner instead of all-gathering.
        quantized: ZeRO++ qwZ: all-gather int8 blocks (one collective per bucket).
    """

    bucket_numel: int = 500_000_000
    broadcast: bool = False
    quantized: bool = False


def chunk_ranges(shard_numel: int, world: int, bucket_numel: int) -> list[tuple[int, int]]:
    """The pieces ``[a, b)`` of every rank's shard gathered by one all-gather each, so that one
    all-gather moves at most ``bucket_numel`` elements (``world`` x piece); at least one element.

    Example:
        >>> chunk_ranges(10, 2, 8)
        [(0, 4), (4, 8), (8, 10)]
        >>> chunk_ranges(10, 2, 100)
        [(0, 10)]
    """
    per = max(1, bucket_numel // world)
    if per >= shard_numel:
        return [(0, shard_numel)]
    return [(a, min(a + per, shard_numel)) for a in range(0, shard_numel, per)]


def launch_publish(
    flat: FlatGroup, policy: PublishPolicy, group: Group, buckets: Sequence[int] | None = None
) -> list[Pending]:
    """Start bringing every rank's updated shard of ``flat`` (of the given ``buckets`` only, in
    that order; default all) to all ranks; returns ``(work, then)`` pairs: wait for ``work``,
    then call ``then``."""
    out: list[Pending] = []
    world = flat.world_size
    buffer = flat.param_buffer
    chosen = range(len(flat.layout.buckets)) if buckets is None else buckets
    for plan, (lo, hi) in ((flat.layout.buckets[b], flat.owned[b]) for b in chosen):
        ranges = [plan.shard_range(r) for r in range(world)]
        if policy.quantized:
            quantized_all_gather(buffer[plan.start : plan.end], buffer[lo:hi], group)
            continue
        if policy.broadcast:
            for r, (a, b) in enumerate(ranges):
                work = collectives.broadcast(
                    buffer[a:b], src=get_global_rank(group, r), group=group, async_op=True
                )
                out.append((work, _nothing))
            continue
        out.extend(flat.param_store.gather(ranges, chunk_ranges(hi - lo, world, policy.bucket_numel)))
    return out


def _nothing() -> None:
    return None
