"""Collectives through shared memory between the ranks of one host (CPU tensors, gloo groups).

Why: gloo moves every byte over loopback TCP. Measured on the project's 2-core machine, an
all-reduce of 69 MB between 2 ranks takes 42 ms, 39 ms of it CPU time in each process, time a
compute-bound rank loses from its forward and backward. Ranks that share a host can instead
read each other's buffers: a reduce-scatter becomes one summing pass over this rank's shard
(about 5 ms for the same 69 MB) and an all-gather one copy. gloo has no shared-memory
transport, and the libraries that do (oneCCL's torch bindings, MPI) are compiled extensions
this project does not take on, so this module does it with what torch already has: tensors
mapped from files (``torch.from_file(shared=True)``) and the group's own barrier.

How:

* :func:`open_shared_memory` checks that every rank of the group runs on this host (same host
  name and boot id) and agrees on a name prefix. :meth:`SharedMemoryGroup.allocate` then gives
  every rank a flat buffer as a file in ``/dev/shm``, its space reserved with
  ``posix_fallocate`` (a full ``/dev/shm`` is an error at creation, never a ``SIGBUS`` later),
  maps every rank's file in every rank, and unlinks the files once all are mapped, so nothing is
  left behind even when a process dies. Either every rank gets its buffers or none does (the
  outcome is agreed by an all-reduce), so ranks never disagree about the transport.
* Synchronisation is a barrier on counters in shared memory (:mod:`shardwise.comm.shm_barrier`,
  x86-64; elsewhere the group's gloo barrier), under the collective timeout: a rank that dies
  cannot hang the others forever. Every collective is fenced by a barrier on entry and on exit,
  so no rank writes a range while another still reads it.
* Sums are taken in rank order (``b0 + b1 + b2 ...``) by whichever rank owns a range, so all
  ranks end with identical values and the result does not depend on timing.
* Memory: a rank reads the other ranks' buffers only inside a collective, and drops their pages
  from its own page tables (``madvise(MADV_DONTNEED)``; their contents stay in their files) as
  soon as it has read each block of ``_DROP_NUMEL`` elements, so between collectives each rank
  holds only its own buffer, as over gloo, and during one at most a block of each other rank's.
  Stage 3's per-unit staging buffers (:meth:`SharedBuffers.gather_shards`,
  :meth:`SharedBuffers.sum_shards`) are small and keep theirs.

Opt out with ``SHARDWISE_SHM_COLLECTIVES=0`` (gloo then carries everything, as before).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import socket
import uuid
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardwise.comm import shm_barrier
from shardwise.comm.comms_logger import COMMS_LOGGER, PendingComm
from shardwise.comm.env import timeout_from_env
from shardwise.comm.group_type import Group

logger = logging.getLogger(__name__)

ENV_SWITCH = "SHARDWISE_SHM_COLLECTIVES"
SHM_DIR = Path("/dev/shm")
# Ranks 2 and up sum through a scratch block of this many elements (they cannot overwrite their
# own values before adding them in rank order); small enough to stay in cache.
_SCRATCH_NUMEL = 1 << 16
# Elements read from the other ranks' buffers between two page drops (4 MiB of fp32): what a
# collective keeps resident of each other rank at a time (see SharedBuffers._drop_peer_pages).
_DROP_NUMEL = 1 << 20


def switched_off() -> bool:
    """Whether ``SHARDWISE_SHM_COLLECTIVES`` turns the shared-memory path off."""
    return os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off")


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _cannot_share(group: Group, device: torch.device) -> str | None:
    """Why this group's collectives cannot go through shared memory, from what every rank of a
    job sees alike (device, group size, backend); None: worth asking the hosts."""
    if device.type != "cpu":
        return f"the tensors are on {device.type}"
    if not dist.is_initialized() or dist.get_world_size(group) < 2:
        return "a single rank"
    if "gloo" not in str(dist.get_backend(group)):
        return f"the {dist.get_backend(group)} backend"
    return None


def _local_refusal() -> str:
    """Why this rank will not share ('' when it will): the switch, or no ``/dev/shm``."""
    if switched_off():
        return f"{ENV_SWITCH}=0"
    if not SHM_DIR.is_dir():
        return f"{SHM_DIR} does not exist"
    return ""


@dataclass
class SharedBuffers:
    """One flat buffer per rank of the group, every rank's mapped here; ``tensors[rank]`` is
    this rank's own (``mine``). The collectives below take ranges of the flat buffers and must be
    called by every rank of the group in the same order."""

    tensors: list[torch.Tensor]
    rank: int
    fence: Callable[[], None]  # the group's barrier
    own_fd: int | None = None  # this rank's file, kept open by ``allocate(releasable=True)``
    nbytes: int = 0
    resident: bool = True

    def __post_init__(self) -> None:
        if self.own_fd is not None:
            weakref.finalize(self, os.close, self.own_fd)

    def release(self) -> None:
        """Give this rank's buffer's memory back to the system (its contents become zeros).
        Only between collectives: every rank must be done reading it (the exit barrier)."""
        if self.own_fd is None or not self.resident:
            return
        if _punch_hole(self.own_fd, self.nbytes):
            self.resident = False

    def reserve(self) -> None:
        """Take this rank's buffer's memory again before writing it (after :meth:`release`), so a
        full ``/dev/shm`` is an error here, never a ``SIGBUS`` on a later write."""
        if self.resident or self.own_fd is None:
            return
        try:
            os.posix_fallocate(self.own_fd, 0, self.nbytes)
        except OSError as exc:
            raise RuntimeError(
                f"rank {self.rank}: {SHM_DIR} has no room for this rank's {self.nbytes / 2**20:.1f} MiB "
                f"gradient staging buffer any more ({exc.strerror}); it had room when training started. Free "
                f"space in {SHM_DIR} or give it more (docker: --shm-size), or set {ENV_SWITCH}=0 to train "
                "through gloo"
            ) from exc
        self.resident = True

    @property
    def mine(self) -> torch.Tensor:
        """This rank's buffer (the one its model and optimizer use)."""
        return self.tensors[self.rank]

    def barrier(self) -> None:
        """Wait until every rank of the group gets here."""
        self.fence()

    def _sum(self, lo: int, hi: int, out: torch.Tensor | None = None, accumulate: bool = False) -> None:
        """The sum over ranks of ``tensors[r][lo:hi]``, added in rank order, written to ``out``
        (default: this rank's own ``mine[lo:hi]``), or added to it with ``accumulate``."""
        if hi <= lo:
            return
        out = self.mine[lo:hi] if out is None else out
        parts = [t[lo:hi] for t in self.tensors]
        if not accumulate and (self.rank <= 1 or not _overlaps(out, self.mine)):
            # out is parts[0], parts[1] or apart from every part: b0 + b1 written in place reads
            # each element before writing it, then the later ranks are added in order
            for a in range(0, hi - lo, _DROP_NUMEL):
                b = min(a + _DROP_NUMEL, hi - lo)
                _add_in_rank_order([part[a:b] for part in parts], out[a:b])
                self._drop_peer_range(lo + a, lo + b)
            return
        scratch = torch.empty(min(_SCRATCH_NUMEL, hi - lo), dtype=out.dtype)
        for a in range(0, hi - lo, _SCRATCH_NUMEL):
            b = min(a + _SCRATCH_NUMEL, hi - lo)
            block = scratch[: b - a]
            _add_in_rank_order([part[a:b] for part in parts], block)
            if accumulate:
                out[a:b].add_(block)
            else:
                out[a:b].copy_(block)
            self._drop_peer_range(lo + a, lo + b)

    def reduce_scatter(
        self, ranges: Sequence[tuple[int, int]], out: torch.Tensor | None = None, accumulate: bool = False
    ) -> None:
        """Each rank's range ``ranges[r]`` (absolute, in the flat buffer) of its own buffer
        becomes the sum of that range over all ranks' buffers; the rest is left as it was. With
        ``out`` (a tensor of that range's size) the sums go there instead, or are added to it
        with ``accumulate``."""
        record = self._record("reduce_scatter_tensor", ranges[self.rank])
        self.barrier()
        self._sum(*ranges[self.rank], out=out, accumulate=accumulate)
        self.barrier()
        self._drop_peer_pages()
        if record is not None:
            record.complete()

    def all_gather(
        self, ranges: Sequence[tuple[int, int]], pieces: Sequence[tuple[int, int]] | None = None
    ) -> None:
        """Every rank's buffer gets each rank ``r``'s range ``ranges[r]`` from rank ``r``'s buffer.
        ``pieces`` (offsets ``[a, b)`` within every rank's range, which are all the same size) are
        gathered one after another, each counted as one all-gather by the comms logger
        (``allgather_bucket_size``); default: the whole ranges at once."""
        self.barrier()
        size = ranges[self.rank][1] - ranges[self.rank][0]
        for a, b in pieces or [(0, size)]:
            record = self._record("all_gather_into_tensor", (a, b))
            self._copy_others([(lo + a, lo + b) for lo, _ in ranges])
            if record is not None:
                record.complete()
        self.barrier()
        self._drop_peer_pages()

    def all_reduce(self, ranges: Sequence[tuple[int, int]]) -> None:
        """The union of ``ranges`` (one per rank, together covering the span to reduce) becomes
        the sum over all ranks' buffers in every rank's buffer: each rank sums its range, then
        copies the others'."""
        record = self._record("all_reduce", (min(a for a, _ in ranges), max(b for _, b in ranges)))
        self.barrier()
        self._sum(*ranges[self.rank])
        self.barrier()
        self._copy_others(ranges)
        self.barrier()
        self._drop_peer_pages()
        if record is not None:
            record.complete()

    def staging(self, numel: int, dtype: torch.dtype, rank: int | None = None) -> torch.Tensor:
        """The first ``numel`` elements of rank ``rank``'s buffer (default: this rank's) viewed
        as ``dtype``: the staging area of :meth:`gather_shards` and :meth:`sum_shards`, whose
        buffers are allocated as bytes (``torch.uint8``)."""
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        return self.tensors[self.rank if rank is None else rank][:nbytes].view(dtype)

    def gather_shards(self, output: torch.Tensor, shard: torch.Tensor) -> None:
        """All-gather into private memory: ``output`` (``world x shard.numel()`` contiguous
        elements) gets every rank's ``shard`` in rank order. Each rank stages its shard in its own
        byte buffer, which must hold ``shard``; ``shard`` may be a view of ``output``."""
        n = shard.numel()
        record = self._record("all_gather_into_tensor", (0, n * shard.element_size()))
        self.staging(n, shard.dtype).copy_(shard.reshape(-1))
        self.barrier()
        rows = output.view(len(self.tensors), n)
        for r in range(len(self.tensors)):
            if r != self.rank:
                rows[r].copy_(self.staging(n, shard.dtype, r))
            elif rows[r].data_ptr() != shard.data_ptr():
                rows[r].copy_(shard.reshape(-1))
        self.barrier()
        if record is not None:
            record.complete()

    def sum_shards(self, output: torch.Tensor, full: torch.Tensor) -> None:
        """Reduce-scatter into private memory: ``output`` (``n`` elements) = the sum over ranks, in
        rank order, of elements ``[rank * n, (rank + 1) * n)`` of every rank's ``full``. ``full`` is
        staged in this rank's byte buffer unless it already is :meth:`staging` (no copy then)."""
        n, dtype = output.numel(), full.dtype
        record = self._record("reduce_scatter_tensor", (0, n * output.element_size()))
        mine = self.staging(full.numel(), dtype)
        if full.data_ptr() != mine.data_ptr():
            mine.copy_(full.reshape(-1))
        self.barrier()
        lo, hi = self.rank * n, (self.rank + 1) * n
        parts = [self.staging(full.numel(), dtype, r)[lo:hi] for r in range(len(self.tensors))]
        _add_in_rank_order(parts, output.view(-1))
        self.barrier()
        if record is not None:
            record.complete()

    def _record(self, op: str, span: tuple[int, int]) -> PendingComm | None:
        """Time the collective for the comms logger (under the name and size of the torch
        collective it replaces: the output shard, the input shard, the whole span), when it is on."""
        if not COMMS_LOGGER.enabled:
            return None
        nbytes = max(0, span[1] - span[0]) * self.mine.element_size()
        return COMMS_LOGGER.start(op, nbytes, len(self.tensors), False)

    def _drop_peer_pages(self) -> None:
        """Take the other ranks' buffers out of this process's resident memory (their contents stay,
        in their files: the next collective maps them in again), so between collectives a rank holds
        only its own buffer, as it would over gloo."""
        for r, tensor in enumerate(self.tensors):
            if r != self.rank:
                _dont_need(tensor)

    def _drop_peer_range(self, lo: int, hi: int) -> None:
        """:meth:`_drop_peer_pages` for elements ``[lo, hi)`` only, as soon as they are read, so a
        collective holds at most about ``_DROP_NUMEL`` elements of each other rank at a time."""
        for r, tensor in enumerate(self.tensors):
            if r != self.rank:
                _dont_need(tensor[lo:hi])

    def _copy_others(self, ranges: Sequence[tuple[int, int]]) -> None:
        mine = self.mine
        for r, (lo, hi) in enumerate(ranges):
            if r == self.rank:
                continue
            for a in range(lo, hi, _DROP_NUMEL):
                b = min(a + _DROP_NUMEL, hi)
                mine[a:b].copy_(self.tensors[r][a:b])
                _dont_need(self.tensors[r][a:b])


def _add_in_rank_order(parts: Sequence[torch.Tensor], out: torch.Tensor) -> None:
    """``out = parts[0] + parts[1] + parts[2] + ...``, added left to right (``out`` may be
    ``parts[0]`` or ``parts[1]``: each element is read before it is written)."""
    torch.add(parts[0], parts[1], out=out)
    for part in parts[2:]:
        out.add_(part)


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors' storages are the same memory."""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
_MADV_DONTNEED = 4


def _dont_need(tensor: torch.Tensor) -> None:
    """``madvise(MADV_DONTNEED)`` over the whole pages inside a file-mapped (contiguous) tensor:
    they leave this process's page tables (a shared file mapping keeps its data; a later read maps
    it again), so they stop counting in this process's resident memory."""
    first = tensor.data_ptr()
    start = -(-first // mmap.PAGESIZE) * mmap.PAGESIZE
    end = (first + tensor.numel() * tensor.element_size()) // mmap.PAGESIZE * mmap.PAGESIZE
    if end <= start:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.madvise(ctypes.c_void_p(start), end - start, _MADV_DONTNEED) != 0:
        logger.debug("could not drop a peer's shared-memory pages: %s", os.strerror(ctypes.get_errno()))


def _punch_hole(fd: int, nbytes: int) -> bool:
    """Free the pages of the file ``fd`` (tmpfs: back to the system; every mapping then reads
    zeros). The standard library has no ``fallocate`` with a mode, so libc's is called."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    whole_pages = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE  # the last partial page too
    done = libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, 0, whole_pages) == 0
    if not done:
        logger.debug("could not release a shared-memory buffer: %s", os.strerror(ctypes.get_errno()))
    return done


def _everyones(reason: str, group: Group) -> str:
    """Every rank's reason (empty: none), joined; the same string on every rank."""
    reasons: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(reasons, reason, group=group)
    return "; ".join(r for r in reasons if r)


class SharedMemoryGroup:
    """Allocates :class:`SharedBuffers` for the ranks of one host (see :func:`open_shared_memory`)."""

    def __init__(self, group: Group, prefix: str, pids: Sequence[int] | None = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self._prefix = prefix
        self._count = 0
        self.barrier: Callable[[], None] = self._gloo_barrier
        if shm_barrier.supported():
            counters = self.allocate(1, torch.int64)
            if not isinstance(counters, str):  # (agreed by every rank, like any allocation)
                timeout = timeout_from_env(os.environ).total_seconds()
                self.barrier = shm_barrier.SpinBarrier(counters.tensors, self.rank, timeout, pids).wait

    def _gloo_barrier(self) -> None:
        dist.barrier(group=self.group)

    def allocate(self, numel: int, dtype: torch.dtype, releasable: bool = False) -> SharedBuffers | str:
        """Zero-filled flat buffers of ``numel`` elements, one per rank, all mapped in every rank.
        Collective: every rank calls it with the same arguments. Returns the reason instead when
        any rank could not get its buffer or map another's (no rank keeps any then).
        ``releasable`` keeps this rank's file open, for :meth:`SharedBuffers.release` and
        :meth:`SharedBuffers.reserve`."""
        self._count += 1
        paths = [SHM_DIR / f"{self._prefix}-{self._count}-{r}" for r in range(self.world)]
        nbytes = max(1, numel) * torch.empty((), dtype=dtype).element_size()
        reason = ""
        kept: int | None = None
        try:
            fd = os.open(paths[self.rank], os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.posix_fallocate(fd, 0, nbytes)
                kept, fd = (fd, -1) if releasable else (None, fd)
            finally:
                if fd >= 0:
                    os.close(fd)
        except OSError as exc:
            reason = (
                f"rank {self.rank} could not reserve {nbytes / 2**20:.1f} MiB in {SHM_DIR}: {exc.strerror}"
            )
        reason = _everyones(reason, self.group)
        tensors: list[torch.Tensor] = []
        if not reason:
            try:
                for p in paths:  # each must be the file its rank made (from_file would create a missing one)
                    if p.stat().st_size < nbytes:
                        raise OSError(0, f"{p} holds {p.stat().st_size} bytes, not {nbytes}")
                tensors = [
                    torch.from_file(str(p), shared=True, size=max(1, numel), dtype=dtype) for p in paths
                ]
            except (OSError, RuntimeError) as exc:
                why = exc.strerror if isinstance(exc, OSError) else str(exc)
                reason = f"rank {self.rank} could not map another rank's buffer in {SHM_DIR} ({why})"
            reason = _everyones(reason, self.group)
        # every rank has mapped what it will map: the names can go (the memory stays while mapped)
        dist.barrier(group=self.group)
        paths[self.rank].unlink(missing_ok=True)
        if reason:
            if kept is not None:
                os.close(kept)
            return reason
        return SharedBuffers([t[:numel] for t in tensors], self.rank, lambda: self.barrier(), kept, nbytes)


def open_shared_memory(group: Group, device: torch.device) -> SharedMemoryGroup | str:
    """A :class:`SharedMemoryGroup` when every rank of ``group`` runs on this host with CPU
    tensors over gloo, otherwise the reason why not. Collective whenever the tensors are on the
    CPU of a gloo group of two or more ranks (it compares what the ranks see)."""
    reason = _cannot_share(group, device)
    if reason is not None:
        return reason
    me = (
        socket.gethostname(),
        _boot_id(),
        f"shardwise-{uuid.uuid4().hex[:16]}",
        _local_refusal(),
        os.getpid(),
        _pid_namespace(),
    )
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, me, group=group)
    refusals = [f"rank {r}: {who[3]}" for r, who in enumerate(everyone) if who[3]]
    if refusals:
        return "; ".join(refusals)
    hosts = {(who[0], who[1]) for who in everyone}
    if len(hosts) > 1:
        return f"the ranks run on {len(hosts)} hosts"
    same_pids = len({who[5] for who in everyone}) == 1 and everyone[0][5] is not None
    return SharedMemoryGroup(group, everyone[0][2], [who[4] for who in everyone] if same_pids else None)


def _pid_namespace() -> int | None:
    """This process's pid namespace (its inode), so process ids are compared only within one."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None
