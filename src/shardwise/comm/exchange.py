"""Reduce-scatter and all-gather as direct point-to-point exchanges (gloo, small groups).

Gloo's collectives move more bytes than ZeRO needs. Its all-reduce (which
:mod:`shardwise.comm.collectives` uses for reduce-scatter above a size, see there) sends
every element twice, a reduce phase and a gather phase, while a rank that keeps only its
shard of the sums needs the first phase alone; its native reduce-scatter and all-gather
allocate buffer-sized temporaries per call. Here every rank instead sends each peer,
with ``isend``/``irecv``, exactly the part that peer owns:

* :func:`reduce_owned`: every rank sends ``buffer[owned[r]]`` (its partial values) to
  rank ``r`` and adds what the peers send for ``buffer[owned[me]]`` into it. Each rank
  sends ``(W - 1) / W`` of the buffer once, the volume of a ring reduce-scatter.
* :func:`gather_owned`: every rank sends ``buffer[owned[me]]`` to every peer and receives
  each peer's range in place. No temporary at all.

Ranges may be any disjoint ``[lo, hi)`` slices, not just equal shards, so the reducer can
reduce a piece of a bucket that cuts across shard boundaries (stages 1 and 2 reduce
their gradients in pieces while backward runs). Messages are cut into pieces of
``PIECE_BYTES`` so receiving, adding and sending overlap (1-4 MiB pieces beat 256 KiB and
16 MiB ones). ``benchmarks/collectives_bench.py`` measures it against an in-place
all-reduce of the whole buffer (2 gloo ranks on the 2-core CI machine, one intra-op thread
each, median of 8 calls of the slower rank): reduce-scatter 0.49-0.84x (fp32, 1-64 MiB) and
0.46-0.80x (bf16, 4-64 MiB; at 1 MiB bf16 it was 1.2x, 2.5 vs 2.0 ms), all-gather 0.45-0.86x;
torch's native reduce-scatter was 1.3-1.9x and its all-gather 0.5-1.6x in the same run.
:func:`shardwise.comm.collectives.choose_algorithm` uses it where that was measured: gloo
groups of two ranks on CPU tensors. With many ranks each rank would keep ``W - 1``
messages in flight per piece; that is correct at any size (tests run 3 ranks) but not
measured, so larger groups keep torch's collectives unless the caller forces it.

Gloo's point-to-point ``Work`` reports completion only through ``wait()`` (``is_completed()``
stays False), so a second phase cannot be chained onto the first while backward runs. That is
why stage 0 keeps gloo's all-reduce: an exchange all-reduce (reduce, then gather) measured
0.8-0.9x in isolation, but its gather could only start when the engine waits, after backward.

Every rank of the group must make the same calls in the same order (as for any
collective): message tags come from a per-group call counter.

Example:
    >>> import torch
    >>> buffer = torch.arange(8.0)  # on each of 2 ranks
    >>> # handle = reduce_owned(buffer, [(0, 4), (4, 8)], async_op=True); handle.wait()
    >>> # rank 0's buffer[0:4] now holds the sums over both ranks of elements 0-3
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["PIECE_BYTES", "check_ranges", "gather_owned", "reduce_owned"]

PIECE_BYTES = 2 * 2**20
"""Largest message: 1-4 MiB measured fastest (see the module docstring)."""
_MAX_PIECES = 256  # per range; bigger ranges get bigger pieces so tags stay in their block
_TAG_BASE = 1 << 29  # far above the small tags user code passes to dist.send/recv
_TAG_SPAN = 1 << 28

_calls: dict[Any, int] = {}


def take_sent() -> bool:
    """Whether this process posted exchange messages since the last call (and forget them): the
    teardown drains the transport first (:func:`shardwise.comm.init.destroy_process_group`)."""
    sent = bool(_calls)
    _calls.clear()
    return sent


def _next_tag_block(group: dist.ProcessGroup | None) -> int:
    key = group if group is not None else dist.group.WORLD
    count = _calls.get(key, 0)
    _calls[key] = count + 1
    return _TAG_BASE + (count * _MAX_PIECES) % _TAG_SPAN


def _pieces(lo: int, hi: int, element_size: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` cut into messages; both ends of an exchange cut a range the same way."""
    if hi <= lo:
        return []
    step = max(PIECE_BYTES // element_size, math.ceil((hi - lo) / _MAX_PIECES))
    return [(start, min(hi, start + step)) for start in range(lo, hi, step)]


def check_ranges(buffer: torch.Tensor, owned: Sequence[tuple[int, int]], world: int) -> None:
    """``buffer`` is contiguous and 1-D, and ``owned`` gives one range inside it per rank."""
    if buffer.dim() != 1 or not buffer.is_contiguous():
        raise ValueError("exchange collectives need a contiguous 1-D buffer (a slice of a flat buffer)")
    if len(owned) != world:
        raise ValueError(
            f"owned must give one (lo, hi) range per rank of the group: {world}, got {len(owned)}"
        )
    for lo, hi in owned:
        if not 0 <= lo <= hi <= buffer.numel():
            raise ValueError(f"owned range ({lo}, {hi}) lies outside the buffer of {buffer.numel()} elements")


class ExchangeHandle:
    """The in-flight messages of one exchange; ``wait()`` completes them and runs ``finish``."""

    def __init__(self, works: list[Any], finish: Callable[[], None]) -> None:
        self._works = works
        self._finish = finish
        self._done = False

    def wait(self, timeout: object = None) -> bool:
        """Block until every message arrived and the result is in place."""
        if not self._done:
            self._finish()
            for work in self._works:
                work.wait() if timeout is None else work.wait(timeout)
            self._done = True
        return True

    def is_completed(self) -> bool:
        """Whether ``wait()`` has finished."""
        return self._done


def reduce_owned(
    buffer: torch.Tensor,
    owned: Sequence[tuple[int, int]],
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    *,
    out: torch.Tensor | None = None,
) -> ExchangeHandle | None:
    """Sum ``buffer`` over the group where each rank needs only its own range.

    Args:
        buffer: this rank's partial values, 1-D and contiguous, the same size on every rank.
        owned: ``(lo, hi)`` per group rank: the range of ``buffer`` that rank keeps.
        group: process group (None: the world).
        async_op: return a handle; read the result only after ``wait()``.
        out: where the sums of this rank's range go (its size); None: into ``buffer[owned[me]]``.

    After completion the sums over all ranks of this rank's range are in ``out`` (or in
    ``buffer`` there); the rest of ``buffer`` is unchanged: this rank's partial values,
    sent to their owners.
    """
    world, me = dist.get_world_size(group), dist.get_rank(group)
    check_ranges(buffer, owned, world)
    lo, hi = owned[me]
    if out is not None:
        if out.numel() != hi - lo or out.dtype != buffer.dtype:
            raise ValueError(f"out must hold this rank's range: {hi - lo} elements of {buffer.dtype}")
        out.view(-1).copy_(buffer[lo:hi])  # this rank's own part is never sent
    base = _next_tag_block(group)
    size = buffer.element_size()
    sends = [
        dist.isend(buffer[a:b], group=group, group_dst=peer, tag=base + k)
        for peer in range(world)
        if peer != me
        for k, (a, b) in enumerate(_pieces(*owned[peer], size))
    ]
    mine = _pieces(lo, hi, size)
    received: list[tuple[Any, torch.Tensor, int, int]] = []
    if mine:
        for peer in range(world):
            if peer == me:
                continue
            for k, (a, b) in enumerate(mine):
                # one small scratch per piece: a scratch of the whole range would be a fresh
                # mmap from 32 MiB on, whose page faults cost as much as the transfer
                part = torch.empty(b - a, dtype=buffer.dtype, device=buffer.device)
                received.append((dist.irecv(part, group=group, group_src=peer, tag=base + k), part, a, b))

    result, shift = (buffer, 0) if out is None else (out.view(-1), lo)

    def finish() -> None:
        for work, part, a, b in received:  # add each piece as soon as it is in
            work.wait()
            result[a - shift : b - shift].add_(part)

    handle = ExchangeHandle(sends, finish)
    if async_op:
        return handle
    handle.wait()
    return None


def gather_owned(
    buffer: torch.Tensor,
    owned: Sequence[tuple[int, int]],
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> ExchangeHandle | None:
    """Fill every rank's range of ``buffer`` from that rank (an all-gather over ranges).

    Args:
        buffer: 1-D and contiguous, the same size on every rank; ``buffer[owned[me]]`` holds
            this rank's values.
        owned: ``(lo, hi)`` per group rank.
        group: process group (None: the world).
        async_op: return a handle; read ``buffer`` only after ``wait()``.
    """
    world, me = dist.get_world_size(group), dist.get_rank(group)
    check_ranges(buffer, owned, world)
    base = _next_tag_block(group)
    size = buffer.element_size()
    works = []
    for peer in range(world):
        if peer == me:
            continue
        for k, (a, b) in enumerate(_pieces(*owned[me], size)):
            works.append(dist.isend(buffer[a:b], group=group, group_dst=peer, tag=base + k))
        for k, (a, b) in enumerate(_pieces(*owned[peer], size)):
            works.append(dist.irecv(buffer[a:b], group=group, group_src=peer, tag=base + k))
    handle = ExchangeHandle(works, lambda: None)
    if async_op:
        return handle
    handle.wait()
    return None
