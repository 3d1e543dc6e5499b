"""Which transport one host's CPU ranks take, and saying so once: shared memory or gloo.

ZeRO's stages 0-2 keep their flat buffers in shared memory and stage 3 stages FSDP2's
collectives there (:mod:`shardwise.comm.shared_memory`) when every rank of the group runs on
this host over gloo; otherwise gloo carries everything. This module is the one place that opens
the shared-memory group for them and the one place that tells the user (rank 0) which transport
was taken and, when a rank could not reserve its buffers, what to do about it: ``zero/`` never
names ``/dev/shm`` or the switch.

ZeRO's stages 0-2 see one :class:`HostTransport`, chosen by :func:`choose_host_transport`: it
allocates their flat buffers (:class:`~shardwise.comm.flat_buffers.FlatBuffer`) and its buffers
carry their collectives. :class:`GlooTransport` gives private buffers whose collectives go through
gloo; :class:`SharedMemoryTransport` gives buffers in shared memory whose collectives read the
other ranks' buffers (``PeerBuffer``), and private ones where it cannot.

Example:
    >>> import torch
    >>> open_host_transport(None, torch.device("cpu"), label="ZeRO stage 1", rank=0, world_size=1) is None
    True
    >>> t = choose_host_transport({torch.device("cpu")}, None, label="ZeRO stage 1", rank=0, world_size=1)
    >>> type(t).__name__, t.allocate(3, torch.float32, torch.device("cpu")).synchronous
    ('GlooTransport', False)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from shardwise.comm.flat_buffers import FlatBuffer, Pending, PrivateBuffer, gloo_reduce, land
from shardwise.comm.group_type import Group
from shardwise.comm.shared_memory import (
    ENV_SWITCH,
    SHM_DIR,
    SharedBuffers,
    SharedMemoryGroup,
    open_shared_memory,
)
from shardwise.utils.logging import logger

__all__ = [
    "GlooTransport",
    "HostTransport",
    "PeerBuffer",
    "SharedMemoryTransport",
    "choose_host_transport",
    "open_host_transport",
    "report_gloo",
    "report_shared",
]


def open_host_transport(
    group: Group, device: torch.device, *, label: str, rank: int, world_size: int
) -> SharedMemoryGroup | None:
    """The shared-memory group when every rank of ``group`` runs on this host with ``device``
    (CPU) tensors over gloo; None (gloo) otherwise, saying why (:func:`report_gloo`). Collective
    whenever it can share (two or more ranks on CPU). ``label`` names the caller in the log
    ("ZeRO stage 1")."""
    if world_size < 2 or device.type != "cpu":
        return None
    opened = open_shared_memory(group, device)
    if isinstance(opened, str):
        report_gloo(label, "collectives", opened, rank)
        return None
    return opened


def _reservation_failed(reason: str) -> bool:
    return reason.startswith("rank ") and "could not" in reason


def report_gloo(label: str, subject: str, reason: str, rank: int, *, failed: bool | None = None) -> None:
    """Say (rank 0) that ``subject`` goes through gloo because of ``reason``.

    A rank that could not reserve or map its buffers (``failed``; by default read from
    ``reason``) is a warning that names the fix (more room in ``/dev/shm``, or the switch); any
    other reason is an info line; nothing when the user chose gloo with the switch.
    """
    if rank != 0 or reason.endswith(f"{ENV_SWITCH}=0"):
        return
    if failed if failed is not None else _reservation_failed(reason):
        logger.warning(
            "%s: %s travel through gloo, not shared memory, because %s; give %s more room (docker: --shm-size) "
            "or set %s=0 to choose gloo and silence this",
            label,
            subject,
            reason,
            SHM_DIR,
            ENV_SWITCH,
        )
    else:
        logger.info("%s: collectives through gloo, not shared memory: %s", label, reason)


def report_shared(label: str, world_size: int, detail: str, rank: int, *, extra: str = "") -> None:
    """Say (rank 0) that ``detail`` goes through shared memory, and how to choose gloo instead."""
    if rank == 0:
        logger.info(
            "%s: the %d ranks share this host: %s through shared memory (%s%s=0: through gloo)",
            label,
            world_size,
            detail,
            extra,
            ENV_SWITCH,
        )


class HostTransport(Protocol):
    """What ZeRO's stages 0-2 need of one host's transport: their flat buffers, whose collectives
    it carries, and one line saying which transport they took."""

    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device) -> FlatBuffer:
        """A zero-filled flat buffer per rank (collective: every rank asks alike)."""
        ...

    def allocate_staging(
        self, numels: Sequence[int], dtype: torch.dtype, device: torch.device
    ) -> list[FlatBuffer]:
        """Releasable buffers, one per bucket of ``numels`` elements, holding memory only between
        their :meth:`~FlatBuffer.reserve` and :meth:`~FlatBuffer.release` (collective)."""
        ...

    def report(self, label: str, detail: str, subject: str) -> None:
        """Say (rank 0) once which transport the buffers took: ``detail`` names what goes through
        shared memory, ``subject`` what would have."""
        ...


class GlooTransport:
    """Private buffers, collectives through the group's backend (gloo on CPU)."""

    def __init__(self, group: Group, rank: int, world_size: int) -> None:
        self.group, self.rank, self.world_size = group, rank, world_size

    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device) -> FlatBuffer:
        """A zero-filled private buffer."""
        return PrivateBuffer(numel, dtype, device, group=self.group, rank=self.rank, world=self.world_size)

    def allocate_staging(
        self, numels: Sequence[int], dtype: torch.dtype, device: torch.device
    ) -> list[FlatBuffer]:
        """Private buffers allocated at each reserve and dropped at each release."""
        return [
            PrivateBuffer(
                n, dtype, device, group=self.group, rank=self.rank, world=self.world_size, releasable=True
            )
            for n in numels
        ]

    def report(self, label: str, detail: str, subject: str) -> None:
        """Nothing more to say: :func:`open_host_transport` said why not shared memory."""


class PeerBuffer:
    """A flat buffer in shared memory whose collectives read the other ranks' buffers (done when
    they return): the shared-memory implementation of :class:`~shardwise.comm.flat_buffers.FlatBuffer`.
    A reduction whose wire is not this buffer (a ``communication_data_type`` copy) goes through
    the group's gloo collectives."""

    synchronous = True

    def __init__(self, buffers: SharedBuffers, group: Group) -> None:
        self.buffers, self.group = buffers, group

    @property
    def mine(self) -> torch.Tensor:
        """This rank's buffer."""
        return self.buffers.mine

    def reserve(self) -> None:
        """Take the buffer's memory again (after :meth:`release`)."""
        self.buffers.reserve()

    def release(self) -> None:
        """Give the buffer's memory back (a releasable one; every rank has read it)."""
        self.buffers.release()

    def gather(self, ranges: Sequence[tuple[int, int]], pieces: Sequence[tuple[int, int]]) -> list[Pending]:
        """Copy the other ranks' ranges from their buffers, piece by piece, now."""
        self.buffers.all_gather(ranges, pieces)
        return []

    def reduce(
        self,
        wire: torch.Tensor,
        ranges: Sequence[tuple[int, int]],
        target: torch.Tensor | None,
        *,
        accumulate: bool,
        everyone: bool,
    ) -> Pending:
        """Sum from the other ranks' buffers, now (the wire is this buffer's span), else through gloo."""
        start = ranges[0][0]
        mine = self.buffers.mine
        rank = self.buffers.rank
        if wire.dtype != mine.dtype or wire.data_ptr() != mine[start:].data_ptr():
            return gloo_reduce(
                wire, ranges, target, accumulate=accumulate, everyone=everyone, rank=rank, group=self.group
            )
        if everyone:
            self.buffers.all_reduce(ranges)
            lo, hi = ranges[rank]
            land(wire[lo - start : hi - start], target, accumulate)
        else:
            assert target is not None, "a reduce-scatter needs the shard it writes"
            self.buffers.reduce_scatter(ranges, out=target, accumulate=accumulate)
        return None, _nothing


def _nothing() -> None:
    return None


class SharedMemoryTransport:
    """Buffers in shared memory (CPU tensors), private ones elsewhere or once a rank could not
    reserve its buffer (``refused`` then says why; every rank agrees)."""

    def __init__(self, opened: SharedMemoryGroup, group: Group, rank: int, world_size: int) -> None:
        self.opened = opened
        self.gloo = GlooTransport(group, rank, world_size)
        self.refused: str | None = None
        self.shared_any = False

    def _shared(
        self, numel: int, dtype: torch.dtype, device: torch.device, releasable: bool
    ) -> FlatBuffer | None:
        if device.type != "cpu" or self.refused is not None:
            return None
        got = self.opened.allocate(numel, dtype, releasable=releasable)
        if isinstance(got, str):
            self.refused = got
            return None
        self.shared_any = True
        return PeerBuffer(got, self.gloo.group)

    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device) -> FlatBuffer:
        """A zero-filled buffer in shared memory, or a private one (not CPU, or refused)."""
        return self._shared(numel, dtype, device, False) or self.gloo.allocate(numel, dtype, device)

    def allocate_staging(
        self, numels: Sequence[int], dtype: torch.dtype, device: torch.device
    ) -> list[FlatBuffer]:
        """One staging buffer in shared memory, released until reserved, when there is one bucket;
        private ones for several (buckets reduced while backward runs would each hold their pages)."""
        if len(numels) == 1:
            staged = self._shared(numels[0], dtype, device, True)
            if staged is not None:
                staged.release()
                return [staged]
        return self.gloo.allocate_staging(numels, dtype, device)

    def report(self, label: str, detail: str, subject: str) -> None:
        """The refusal with its fix (a warning), or what goes through shared memory."""
        rank, world = self.gloo.rank, self.gloo.world_size
        if self.refused is not None:
            report_gloo(label, subject, self.refused, rank, failed=True)
        elif self.shared_any:
            report_shared(label, world, detail, rank)


def choose_host_transport(
    devices: set[torch.device], group: Group, *, label: str, rank: int, world_size: int
) -> HostTransport:
    """The transport for buffers on ``devices``: shared memory when every rank of ``group`` runs
    on this host with CPU tensors over gloo, else gloo (saying why, :func:`report_gloo`).
    Collective whenever it can share."""
    device = torch.device("cpu") if devices <= {torch.device("cpu")} else next(iter(devices))
    opened = open_host_transport(group, device, label=label, rank=rank, world_size=world_size)
    if opened is None:
        return GlooTransport(group, rank, world_size)
    return SharedMemoryTransport(opened, group, rank, world_size)
