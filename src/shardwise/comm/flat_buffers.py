"""One rank's flat buffer and the collectives over every rank's buffer of the same layout: the
gloo implementation (:class:`PrivateBuffer`), and the shape both transports share (:class:`FlatBuffer`).

A ZeRO flat group (stages 0-2) asks its :class:`~shardwise.comm.host_transport.HostTransport`
for its buffers and calls their collectives; it never asks which transport it got. Over gloo a
buffer is this process's own memory and a collective is launched asynchronously: it returns a
:data:`Pending` (wait for the work, then call the continuation). Over shared memory
(:mod:`shardwise.comm.host_transport`'s ``PeerBuffer``) the same calls read the other ranks'
buffers and are done when they return.

Example:
    >>> import torch
    >>> buffer = PrivateBuffer(4, torch.float32, torch.device("cpu"), group=None, rank=0, world=1)
    >>> buffer.mine.tolist(), buffer.synchronous
    ([0.0, 0.0, 0.0, 0.0], False)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from shardwise.comm import collectives
from shardwise.comm.group_type import Group

__all__ = ["FlatBuffer", "Pending", "PrivateBuffer", "gloo_reduce", "land"]

# A launched collective: wait for the work (None: already done), then call the continuation.
Pending = tuple[Any, Callable[[], None]]


def _nothing() -> None:
    return None


class FlatBuffer(Protocol):
    """This rank's flat buffer (``mine``) and the collectives over every rank's buffer of the same
    layout. Ranges are absolute ``[lo, hi)`` in the flat buffer, one per rank, in rank order; every
    rank calls the collectives in the same order."""

    @property
    def synchronous(self) -> bool:
        """Whether the collectives are done when they return (nothing to overlap or leave in flight)."""
        ...

    @property
    def mine(self) -> torch.Tensor:
        """This rank's buffer (its memory must be :meth:`reserve`-d when it is releasable)."""
        ...

    def reserve(self) -> None:
        """Take the buffer's memory (a releasable one, before writing it); otherwise nothing."""
        ...

    def release(self) -> None:
        """Give a releasable buffer's memory back once every rank is done with it; otherwise nothing."""
        ...

    def gather(self, ranges: Sequence[tuple[int, int]], pieces: Sequence[tuple[int, int]]) -> list[Pending]:
        """Every rank's buffer gets rank ``r``'s range ``ranges[r]``; ``pieces`` (offsets within a
        range) go one after another, each one all-gather."""
        ...

    def reduce(
        self,
        wire: torch.Tensor,
        ranges: Sequence[tuple[int, int]],
        target: torch.Tensor | None,
        *,
        accumulate: bool,
        everyone: bool,
    ) -> Pending:
        """Sum ``wire`` (the span ``ranges`` cover, as it goes on the wire) over the ranks: every
        rank gets all of it (``everyone``: an all-reduce) or its range (a reduce-scatter); this
        rank's range of the sums then lands in ``target`` (added with ``accumulate``), or stays
        in ``wire`` when ``target`` is None."""
        ...


def land(sums: torch.Tensor, target: torch.Tensor | None, accumulate: bool) -> None:
    """Put this rank's ``sums`` into ``target`` (add them with ``accumulate``); nothing when they
    are already there (``target`` None, or the same tensor)."""
    if target is None or sums is target:
        return
    if accumulate:
        target.add_(sums)
    else:
        target.copy_(sums)


def gloo_reduce(
    wire: torch.Tensor,
    ranges: Sequence[tuple[int, int]],
    target: torch.Tensor | None,
    *,
    accumulate: bool,
    everyone: bool,
    rank: int,
    group: Group,
) -> Pending:
    """:meth:`FlatBuffer.reduce` through the group's own collectives, asynchronously."""
    start = ranges[0][0]
    lo, hi = ranges[rank]
    out: torch.Tensor
    if everyone:
        work = collectives.all_reduce(wire, op="sum", group=group, async_op=True)
        out = wire[lo - start : hi - start]
    else:
        assert target is not None, "a reduce-scatter needs the shard it writes"
        direct = wire.dtype == target.dtype and not accumulate
        out = target if direct else torch.empty(hi - lo, dtype=wire.dtype, device=wire.device)
        work = collectives.reduce_scatter_flat(out, wire, group=group, async_op=True, input_is_scratch=True)
    return work, lambda: land(out, target, accumulate)


class PrivateBuffer:
    """A flat buffer in this process's own memory whose collectives go through gloo (or the
    group's backend), asynchronously: the gloo implementation of :class:`FlatBuffer`.
    ``releasable``: it holds no memory until :meth:`reserve` (then uninitialised) and gives it
    back at :meth:`release` (otherwise zero-filled for good)."""

    synchronous = False

    def __init__(
        self,
        numel: int,
        dtype: torch.dtype,
        device: torch.device,
        *,
        group: Group,
        rank: int,
        world: int,
        releasable: bool = False,
    ) -> None:
        self._numel, self._dtype, self._device = numel, dtype, device
        self.group, self.rank, self.world = group, rank, world
        self.releasable = releasable
        self._tensor: torch.Tensor | None = (
            None if releasable else torch.zeros(numel, dtype=dtype, device=device)
        )

    @property
    def mine(self) -> torch.Tensor:
        """This rank's buffer."""
        assert self._tensor is not None, "a releasable buffer is reserved before use"
        return self._tensor

    def reserve(self) -> None:
        """A releasable buffer gets (uninitialised) memory, unless it holds some."""
        if self._tensor is None:
            self._tensor = torch.empty(self._numel, dtype=self._dtype, device=self._device)

    def release(self) -> None:
        """A releasable buffer drops its memory (the next :meth:`reserve` takes new)."""
        if self.releasable:
            self._tensor = None

    def gather(self, ranges: Sequence[tuple[int, int]], pieces: Sequence[tuple[int, int]]) -> list[Pending]:
        """One asynchronous all-gather per piece: the whole span in place for one piece, else each
        piece into a scratch buffer, copied to the owners' places once it is done."""
        buffer = self.mine
        lo, hi = ranges[self.rank]
        if len(pieces) == 1 and pieces[0] == (0, hi - lo):
            span = buffer[ranges[0][0] : ranges[-1][1]]
            return [
                (collectives.all_gather_flat(span, buffer[lo:hi], group=self.group, async_op=True), _nothing)
            ]
        out: list[Pending] = []
        for a, b in pieces:
            scratch = torch.empty(self.world * (b - a), dtype=buffer.dtype, device=buffer.device)
            work = collectives.all_gather_flat(
                scratch, buffer[lo + a : lo + b].clone(), group=self.group, async_op=True
            )
            out.append((work, _scatter(buffer, scratch, ranges, a, b)))
        return out

    def reduce(
        self,
        wire: torch.Tensor,
        ranges: Sequence[tuple[int, int]],
        target: torch.Tensor | None,
        *,
        accumulate: bool,
        everyone: bool,
    ) -> Pending:
        """:meth:`FlatBuffer.reduce` through gloo, asynchronously."""
        return gloo_reduce(
            wire, ranges, target, accumulate=accumulate, everyone=everyone, rank=self.rank, group=self.group
        )


def _scatter(
    buffer: torch.Tensor, scratch: torch.Tensor, ranges: Sequence[tuple[int, int]], a: int, b: int
) -> Callable[[], None]:
    def then() -> None:
        n = b - a
        for r, (start, _end) in enumerate(ranges):
            buffer[start + a : start + b].copy_(scratch[r * n : (r + 1) * n])

    return then
