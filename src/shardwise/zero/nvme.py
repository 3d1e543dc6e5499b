"""Tensors in files: the NVMe side of ZeRO offload, driven by the ``aio`` section.

One :class:`SwapFile` per offload store and rank holds many tensors at fixed offsets.
Reads and writes are split into ``aio.block_size`` requests and run on a small thread
pool (``os.pread``/``os.pwrite`` release the GIL, so requests proceed in parallel):
``intra_op_parallelism`` threads with ``queue_depth`` requests in flight each, or one
request at a time with ``single_submit``. Every operation returns a :class:`IoHandle`
to wait on, so callers can overlap I/O with the optimizer step.

No compiled extension: this is plain POSIX file I/O into the tensors' own memory.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import mmap
import os
import shutil
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from shardwise.utils.logging import logger


@dataclass(frozen=True)
class AioSettings:
    """The ``aio`` section, as the swap file uses it."""

    block_size: int = 1_048_576
    queue_depth: int = 8
    intra_op_parallelism: int = 1
    single_submit: bool = False
    overlap_events: bool = True

    @property
    def workers(self) -> int:
        """Threads issuing requests (bounded: a few threads saturate a local disk)."""
        if self.single_submit:
            return 1
        return max(1, min(32, self.intra_op_parallelism * self.queue_depth))


class IoHandle:
    """Pending reads/writes of one tensor; ``wait()`` raises the first I/O error."""

    def __init__(self, futures: list[Future[None]], keep: torch.Tensor | None = None) -> None:
        self._futures = futures
        self._keep = keep  # the tensor whose memory the requests use

    def wait(self) -> None:
        """Block until every request finished."""
        for future in self._futures:
            future.result()
        self._futures = []
        self._keep = None

    def done(self) -> bool:
        """True when nothing is pending."""
        return all(f.done() for f in self._futures)


def _bytes_view(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (any dtype).

    Built with ctypes rather than ``.numpy()``: exporting to numpy marks the storage as
    not resizable, and the parameter swapper frees storages with ``resize_(0)``. The
    caller keeps the tensor alive until the I/O is waited for.
    """
    assert tensor.is_contiguous() and tensor.device.type == "cpu", "swap I/O needs contiguous host tensors"
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


class SwapFile:
    """A file of tensors at fixed byte offsets, with parallel block I/O.

    Example:
        >>> import tempfile, torch
        >>> with tempfile.TemporaryDirectory() as d:
        ...     f = SwapFile(Path(d), "demo", AioSettings(block_size=8))
        ...     off = f.allocate(16)
        ...     f.write(torch.arange(4.0), off).wait()
        ...     out = torch.zeros(4)
        ...     f.read(out, off).wait()
        ...     f.close()
        ...     out.tolist()
        [0.0, 1.0, 2.0, 3.0]
    """

    _pools: dict[int, ThreadPoolExecutor] = {}
    _pool_lock = threading.Lock()

    def __init__(self, directory: Path, name: str, aio: AioSettings, align: int = 512) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / f"{name}.swp"
        self.aio = aio
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        self._size = 0
        # sector-aligned slots by default (small tensors waste little, requests stay aligned);
        # files whose slots are memory-mapped one by one use mmap.ALLOCATIONGRANULARITY
        self._align = align

    @classmethod
    def _pool(cls, workers: int) -> ThreadPoolExecutor:
        with cls._pool_lock:
            pool = cls._pools.get(workers)
            if pool is None:
                pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="shardwise-aio")
                cls._pools[workers] = pool
            return pool

    @property
    def nbytes(self) -> int:
        """Bytes reserved in the file."""
        return self._size

    def allocate(self, nbytes: int) -> int:
        """Reserve ``nbytes`` at the end of the file; returns the offset."""
        offset = self._size
        self._size += -(-nbytes // self._align) * self._align
        os.ftruncate(self._fd, self._size)
        return offset

    def _submit(self, tensor: torch.Tensor, offset: int, write: bool) -> IoHandle:
        view = _bytes_view(tensor)
        block = max(1, self.aio.block_size)
        pool = self._pool(self.aio.workers)
        fd = self._fd

        def run(lo: int, hi: int) -> None:
            chunk = view[lo:hi]
            done = 0
            while done < len(chunk):  # short reads/writes are legal: finish them
                if write:
                    n = os.pwrite(fd, chunk[done:], offset + lo + done)
                else:
                    n = os.preadv(fd, [chunk[done:]], offset + lo + done)
                if n <= 0:
                    raise OSError(
                        f"{'write' if write else 'read'} of {self.path} returned {n} at {offset + lo + done}"
                    )
                done += n

        futures = [pool.submit(run, lo, min(lo + block, len(view))) for lo in range(0, len(view), block)]
        return IoHandle(futures, keep=tensor)

    def write(self, tensor: torch.Tensor, offset: int) -> IoHandle:
        """Start writing ``tensor`` (contiguous, on the host) at ``offset``."""
        return self._submit(tensor, offset, write=True)

    def read(self, tensor: torch.Tensor, offset: int) -> IoHandle:
        """Start reading into ``tensor`` (contiguous, on the host) from ``offset``."""
        return self._submit(tensor, offset, write=False)

    def map_private(self) -> mmap.mmap:
        """The whole file as a private, copy-on-write memory map (writes to it stay in memory).

        It stays valid after :meth:`close` (and after the file is deleted) while in use."""
        return mmap.mmap(self._fd, self._size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)

    def map_range(self, offset: int, nbytes: int) -> mmap.mmap:
        """``nbytes`` at ``offset`` (a multiple of ``mmap.ALLOCATIONGRANULARITY``) as a private,
        copy-on-write map: pages are read from the file on first touch and, while unwritten,
        can be dropped again with :func:`drop_pages`. The map outlives the file's deletion."""
        return mmap.mmap(
            self._fd, nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=offset
        )

    def close(self, remove: bool = True) -> None:
        """Close (and by default delete) the file."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            if remove:
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown: never raise from a finaliser
            self.close()


def mapped_tensor(mapping: mmap.mmap, like: torch.Tensor) -> torch.Tensor:
    """A tensor of ``like``'s shape and dtype over the memory of ``mapping`` (which it keeps alive)."""
    nbytes = like.numel() * like.element_size()
    flat = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes)
    return flat.view(like.dtype).view(like.shape)


def drop_pages(mapping: mmap.mmap) -> None:
    """Release the memory pages of a private file map (``MADV_DONTNEED``): the next read pages the
    file in again. Only for maps nobody wrote to (written pages would revert to the file's bytes)."""
    mapping.madvise(mmap.MADV_DONTNEED)


class MappedStash:
    """Tensors written once to a swap file and kept as private maps of it (``zero.Init`` with
    ``remote_device="nvme"``): building a model larger than memory holds only the parameters being
    constructed in memory; the rest is the kernel's page cache, which it can drop.

    The file is deleted by :meth:`seal` (when construction is over); the maps keep their bytes until
    each tensor is released.
    """

    def __init__(self, directory: Path, aio: AioSettings) -> None:
        self._directory = directory
        self._file: SwapFile | None = SwapFile(directory, "stash", aio, align=mmap.ALLOCATIONGRANULARITY)

    def put(self, tensor: torch.Tensor) -> tuple[torch.Tensor, mmap.mmap | None]:
        """Write ``tensor`` to the file; returns a mapped tensor with its values, and its map."""
        if tensor.numel() == 0:
            return tensor, None
        assert self._file is not None, "MappedStash.put after seal()"
        tensor = tensor.contiguous()
        offset = self._file.allocate(tensor.numel() * tensor.element_size())
        self._file.write(tensor, offset).wait()
        mapping = self._file.map_range(offset, tensor.numel() * tensor.element_size())
        return mapped_tensor(mapping, tensor), mapping

    def seal(self) -> None:
        """No more tensors: delete the file (the maps stay valid)."""
        if self._file is not None:
            self._file.close()
            self._file = None
            remove_directory(self._directory)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown: never raise from a finaliser
            self.seal()


_DIRECTORY_NUMBERS = itertools.count()


def swap_directory(nvme_path: Path, kind: str, rank: int) -> Path:
    """``<nvme_path>/shardwise/<kind>/rank<r>-pid<p>-<n>``: one directory per rank, process
    and store (a second engine in the same process never shares, or deletes, the first's)."""
    return Path(nvme_path) / "shardwise" / kind / f"rank{rank}-pid{os.getpid()}-{next(_DIRECTORY_NUMBERS)}"


def remove_directory(path: Path) -> None:
    """Delete a swap directory, then its ``shardwise/<kind>`` parents if they are left empty."""
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.warning("could not remove the swap directory %s: %s", path, exc)
        return
    for parent in (path.parent, path.parent.parent):  # <kind>, then shardwise
        try:
            parent.rmdir()  # only succeeds when empty: other ranks' files stay
        except OSError:
            break
