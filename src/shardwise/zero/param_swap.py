"""NVMe parameter offload at stage 3: sharded parameters live in a file, in memory only while used.

FSDP2 keeps each sharded parameter in one padded storage. :class:`ParamSwapper` writes those
storages to a swap file under ``offload_param.nvme_path`` and frees their memory (unit by unit
as the model is sharded, so a model larger than memory never has all its shards in memory).

While evicted, each storage is backed by a private, copy-on-write memory map of its bytes in
the swap file (the storage's data pointer is exchanged in place, so every view, FSDP2's and the
optimizer's included, stays valid): memory the kernel pages in from the file on demand. A
unit's all-gather reads its shards through that map, and the pages are released again right
after (:meth:`ParamSwapper.drop_pages`, called from the unit's all-gather hook), so forward and
backward hold one unit's shards at a time, not the model's. The optimizer step brings storages
back into memory a sub-group at a time (``begin_restore``), steps them and writes them back
(``begin_evict``), next to the optimizer state it streams from its own file
(:class:`~shardwise.zero.offload.OffloadStore`).

Code that reads a parameter between steps (``p.full_tensor()``, ``p.to_local()``) sees its
current values through the map; edits made there are not kept (they are not written back:
change parameters inside ``shardwise.zero.GatheredParameters(..., modifier_rank=...)``).
Checkpointing and ``state_dict`` bring every storage back into memory first (``restore``).

Requests are ``offload_param.buffer_size`` bytes, with the ``aio`` thread settings; at most
``buffer_count`` storages are in flight at once in the bulk operations.
"""

from __future__ import annotations

import dataclasses
import mmap
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from shardwise.comm.fsdp_internals import local_tensor
from shardwise.zero.nvme import IoHandle, SwapFile, drop_pages, remove_directory, swap_directory
from shardwise.zero.offload_spec import OffloadSpec


def _storage_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over a whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def storage_exchange_available() -> bool:
    """Whether this torch can exchange two storages' memory in place
    (``UntypedStorage._swap_data_ptr_``, private: present in torch 2.13.0, absent in 2.11.0)."""
    return hasattr(torch.UntypedStorage, "_swap_data_ptr_")


def require_storage_exchange() -> None:
    """Raise a clear error when NVMe parameter offload cannot run on this torch."""
    if not storage_exchange_available():
        raise RuntimeError(
            f"zero_optimization.offload_param.device='nvme' (stage 3) needs torch's in-place storage "
            f"exchange (torch.UntypedStorage._swap_data_ptr_), which torch {torch.__version__} lacks "
            "(checked: absent in 2.11.0, present in 2.13.0). Fix: use torch 2.13, or set "
            "offload_param.device to 'cpu' or 'none'."
        )


def _exchange_memory(storage: torch.UntypedStorage, replacement: torch.Tensor) -> None:
    """Give ``storage`` the memory of ``replacement`` (same size) in place; ``replacement``
    takes the old memory, released when it is dropped. Views of ``storage`` follow."""
    other = replacement.untyped_storage()
    assert other.nbytes() == storage.nbytes(), "exchanged memory must have the storage's size"
    storage._swap_data_ptr_(other)  # type: ignore[attr-defined]  # torch's in-place exchange of the two storages' memory


class _Pending:
    """A storage's restore or eviction in flight; ``wait()`` finishes it (IoHandle-like)."""

    def __init__(self, handle: IoHandle, finish: Callable[[], None]) -> None:
        self._handle = handle
        self._finish: Callable[[], None] | None = finish

    def wait(self) -> None:
        """Wait for the I/O, then exchange the storage's memory."""
        self._handle.wait()
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()


class ParamSwapper:
    """Evict/restore the storages of sharded parameters to/from one swap file, storage by storage.

    Args:
        spec: the ``offload_param`` block (device ``nvme``).
        rank: names the swap directory.
        params: sharded (DTensor) parameters to add now (more with :meth:`add`); they stay in
            memory until evicted.
    """

    def __init__(self, spec: OffloadSpec, rank: int, params: Sequence[nn.Parameter] = ()) -> None:
        assert spec.nvme_path is not None, "nvme parameter offload needs nvme_path (validated by the config)"
        require_storage_exchange()
        self.spec = spec
        aio = dataclasses.replace(spec.aio, block_size=max(spec.aio.block_size, spec.buffer_size))
        self._directory = swap_directory(spec.nvme_path, "param", rank)
        self.file = SwapFile(self._directory, "params", aio, align=mmap.ALLOCATIONGRANULARITY)
        self._finalizer = weakref.finalize(self, remove_directory, self._directory)
        self.storages: list[torch.UntypedStorage] = []
        self.nbytes: list[int] = []
        self.offsets: list[int] = []
        self._maps: list[mmap.mmap | None] = []  # the storage's file map while evicted, else None
        self._index: dict[int, int] = {}  # storage identity (StorageImpl address) -> index
        self.add(params)

    def add(self, params: Sequence[nn.Parameter]) -> list[int]:
        """Take on the storages of these sharded parameters (resident); returns their indices,
        including those of storages already known."""
        indices: list[int] = []
        for p in params:
            index = self.index_of(p)
            if index is None:
                storage = local_tensor(p).untyped_storage()
                if storage.nbytes() == 0:
                    continue
                index = len(self.storages)
                self._index[storage._cdata] = index
                self.storages.append(storage)
                self.nbytes.append(storage.nbytes())
                self.offsets.append(self.file.allocate(storage.nbytes()))
                self._maps.append(None)
            if index not in indices:
                indices.append(index)
        return indices

    def index_of(self, tensor: torch.Tensor) -> int | None:
        """The index of the storage under ``tensor`` (a DTensor parameter or a view of its local
        shard), or None when it is not swapped."""
        local = local_tensor(tensor)
        return self._index.get(local.untyped_storage()._cdata)

    @property
    def file_bytes(self) -> int:
        """Bytes reserved in the swap file."""
        return self.file.nbytes

    @property
    def resident(self) -> bool:
        """True when every storage is in memory (none is a map of the file)."""
        return all(m is None for m in self._maps)

    def is_mapped(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s storage currently lives in the swap file."""
        index = self.index_of(tensor)
        return index is not None and self._maps[index] is not None

    def _all(self, indices: Sequence[int] | None) -> Sequence[int]:
        return range(len(self.storages)) if indices is None else indices

    # ------------------------------------------------------------------ one storage at a time
    def begin_evict(self, index: int) -> _Pending | None:
        """Start writing a resident storage to the file; ``wait()`` then frees its memory."""
        if self._maps[index] is not None:
            return None
        storage, nbytes, offset = self.storages[index], self.nbytes[index], self.offsets[index]
        handle = self.file.write(_storage_bytes(storage), offset)

        def finish() -> None:
            mapping = self.file.map_range(offset, nbytes)
            _exchange_memory(storage, torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes))
            self._maps[index] = mapping  # the storage's data pointer keeps the map alive too

        return _Pending(handle, finish)

    def begin_restore(self, index: int) -> _Pending | None:
        """Start reading an evicted storage into fresh memory; ``wait()`` then installs it."""
        if self._maps[index] is None:
            return None
        fresh = torch.empty(self.nbytes[index], dtype=torch.uint8)
        handle = self.file.read(fresh, self.offsets[index])

        def finish() -> None:
            _exchange_memory(self.storages[index], fresh)  # ``fresh`` now holds the map: dropped here
            self._maps[index] = None

        return _Pending(handle, finish)

    def drop_pages(self, indices: Sequence[int]) -> None:
        """Release the memory pages of these storages' maps (the file keeps the values)."""
        for index in indices:
            mapping = self._maps[index]
            if mapping is not None:
                drop_pages(mapping)

    # ------------------------------------------------------------------ bulk
    def _run(self, pending: Iterator[_Pending | None]) -> None:
        limit = max(1, self.spec.buffer_count)
        flight: list[_Pending] = []
        for item in pending:
            if item is None:
                continue
            flight.append(item)
            while len(flight) >= limit:
                flight.pop(0).wait()
        for item in flight:
            item.wait()

    def evict(self, indices: Sequence[int] | None = None) -> None:
        """Write these storages (default: all) to the file, then free their memory."""
        self._run(self.begin_evict(i) for i in self._all(indices))

    def restore(self, indices: Sequence[int] | None = None) -> None:
        """Read these storages (default: all) back into memory."""
        self._run(self.begin_restore(i) for i in self._all(indices))

    def close(self) -> None:
        """Restore the parameters and delete the file."""
        self.restore()
        self.file.close()
        self._finalizer()  # removes the directory, once


class SwappedMasters:
    """The optimizer store's companion at stage 3 with NVMe parameters and NVMe optimizer state
    (:class:`~shardwise.zero.offload.StreamCompanion`): a sub-group's masters are the sharded
    parameters themselves, brought into memory before it steps and written back after."""

    def __init__(self, swapper: ParamSwapper | None, tensors: Sequence[torch.Tensor]) -> None:
        assert swapper is not None, "SwappedMasters needs the parameter swapper"
        self.swapper = swapper
        self.tensors = tensors

    def _storages(self, indices: Sequence[int]) -> list[int]:
        found = (self.swapper.index_of(self.tensors[i]) for i in indices)
        return sorted({i for i in found if i is not None})

    def load(self, indices: Sequence[int]) -> list[_Pending]:
        """Start reading these masters' storages into memory."""
        pending = (self.swapper.begin_restore(i) for i in self._storages(indices))
        return [p for p in pending if p is not None]

    def save(self, indices: Sequence[int]) -> list[_Pending]:
        """Start writing these masters' storages back (their memory goes when waited for)."""
        pending = (self.swapper.begin_evict(i) for i in self._storages(indices))
        return [p for p in pending if p is not None]

    def bring_in_unstreamed(self, store: Any) -> None:
        """Masters the store steps outside its streamed sub-groups (``ratio`` < 1) come in whole."""
        self.swapper.restore(self._storages(range(store.offloaded, len(self.tensors))))
