"""NVMe parameter offload at stage 3: sharded parameters live in a file between steps.

FSDP2 keeps each sharded parameter in one padded storage (with ``offload_param`` on the
host, through ``CPUOffloadPolicy``). Between optimizer steps :class:`ParamSwapper` writes
those storages to a swap file under ``offload_param.nvme_path`` and frees their memory;
the root module's forward pre-hook, a ``state_dict`` call or ``GatheredParameters`` read
them back before training touches them.

While evicted, each storage is backed by a private, copy-on-write memory map of its bytes
in the swap file (the storage's data pointer is exchanged in place, so every view, FSDP2's
and the optimizer's included, stays valid): memory the kernel pages in from the file on
demand and may drop again, not a copy. Code that reads a parameter between steps
(``p.full_tensor()``, ``p.to_local()``) therefore sees its current values instead of
freed memory; edits made there are not kept (they are not written back: change
parameters inside ``shardwise.zero.GatheredParameters(..., modifier_rank=...)``).

Requests are ``offload_param.buffer_size`` bytes, with the ``aio`` thread settings; at
most ``buffer_count`` storages are in flight at once.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Sequence

import torch
from torch import nn

from shardwise.zero.nvme import IoHandle, SwapFile, remove_directory, swap_directory
from shardwise.zero.offload import OffloadSpec


def _storage_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over a whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _exchange_memory(storage: torch.UntypedStorage, replacement: torch.Tensor) -> None:
    """Give ``storage`` the memory of ``replacement`` (same size) in place; ``replacement``
    takes the old memory, released when it is dropped. Views of ``storage`` follow."""
    other = replacement.untyped_storage()
    assert other.nbytes() == storage.nbytes(), "exchanged memory must have the storage's size"
    storage._swap_data_ptr_(other)  # type: ignore[attr-defined]  # torch's in-place exchange of the two storages' memory


class ParamSwapper:
    """Evict/restore the storages of sharded parameters to/from one swap file.

    Args:
        params: sharded (DTensor) parameters; their local storages are swapped.
        spec: the ``offload_param`` block (device ``nvme``).
        rank: names the swap directory.
    """

    def __init__(self, params: Sequence[nn.Parameter], spec: OffloadSpec, rank: int) -> None:
        assert spec.nvme_path is not None, "nvme parameter offload needs nvme_path (validated by the config)"
        self.spec = spec
        aio = dataclasses.replace(spec.aio, block_size=max(spec.aio.block_size, spec.buffer_size))
        self._directory = swap_directory(spec.nvme_path, "param", rank)
        self.file = SwapFile(self._directory, "params", aio)
        self._finalizer = weakref.finalize(self, remove_directory, self._directory)
        self.storages: list[torch.UntypedStorage] = []
        self.nbytes: list[int] = []
        self.offsets: list[int] = []
        seen: set[int] = set()
        for p in params:
            storage = p._local_tensor.untyped_storage()  # type: ignore[attr-defined]
            key = storage.data_ptr()
            if storage.nbytes() == 0 or key in seen:
                continue
            seen.add(key)
            self.storages.append(storage)
            self.nbytes.append(storage.nbytes())
            self.offsets.append(self.file.allocate(storage.nbytes()))
        self.resident = True

    @property
    def file_bytes(self) -> int:
        """Bytes reserved in the swap file."""
        return self.file.nbytes

    def _in_flight(self, start: list[IoHandle]) -> None:
        limit = max(1, self.spec.buffer_count)
        while len(start) >= limit:
            start.pop(0).wait()

    def evict(self) -> None:
        """Write every storage to the file, then free it."""
        if not self.resident:
            return
        pending: list[IoHandle] = []
        for storage, offset in zip(self.storages, self.offsets):
            self._in_flight(pending)
            pending.append(self.file.write(_storage_bytes(storage), offset))
        for handle in pending:
            handle.wait()
        if self.storages:
            # copy-on-write map of the file: reads page in from it, nothing is written back
            mapped = self.file.map_private()
            for storage, nbytes, offset in zip(self.storages, self.nbytes, self.offsets):
                _exchange_memory(
                    storage, torch.frombuffer(mapped, dtype=torch.uint8, count=nbytes, offset=offset)
                )
        self.resident = False

    def restore(self) -> None:
        """Re-allocate every storage and read it back from the file."""
        if self.resident:
            return
        pending: list[IoHandle] = []
        fresh = [torch.empty(nbytes, dtype=torch.uint8) for nbytes in self.nbytes]
        for buffer, offset in zip(fresh, self.offsets):
            self._in_flight(pending)
            pending.append(self.file.read(buffer, offset))
        for handle in pending:
            handle.wait()
        for storage, buffer in zip(self.storages, fresh):
            _exchange_memory(storage, buffer)  # the map is released with ``fresh``
        self.resident = True

    def close(self) -> None:
        """Restore the parameters and delete the file."""
        self.restore()
        self.file.close()
        self._finalizer()  # removes the directory, once
