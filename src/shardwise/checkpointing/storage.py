"""How a checkpoint's saved inputs are kept until backward: as they are, split across the
model-parallel group (``partition_activations``), in host memory (``cpu_checkpointing``), in a
preallocated buffer (``contiguous_memory_optimization``), or a combination (spec 3.12).

:func:`pack` and :func:`unpack` are ``torch.autograd.graph.saved_tensors_hooks`` callbacks:
``checkpoint`` installs them around ``torch.utils.checkpoint``'s reentrant function, whose only
saved tensors are the checkpoint's inputs, and the non-reentrant variant calls them on the
inputs it keeps for the recompute. A tensor is transformed when it is an activation in
DeepSpeed's sense (floating point, at least one element per model-parallel rank, not a
parameter); anything else is kept as it is.

Partitioning pads the flattened tensor to a multiple of the group size, keeps this rank's
slice (a copy, so the full tensor can be freed) and all-gathers the slices through
``shardwise.comm`` for the recompute. The model-parallel ranks must hold the same activation
(as tensor-parallel ranks do), and call backward in the same order.

Example:
    >>> import torch
    >>> from shardwise.checkpointing.settings import CheckpointingSettings, current_settings
    >>> store = ActivationStorage(CheckpointingSettings(cpu_checkpointing=True))
    >>> x = torch.arange(6.0).view(2, 3)
    >>> torch.equal(store.unpack(store.pack(x)), x)
    True
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from shardwise.checkpointing.contiguous import ContiguousPool, Slot
from shardwise.checkpointing.meter import record_stored
from shardwise.checkpointing.settings import CheckpointingSettings, current_settings, missing_slot_count

__all__ = ["ActivationStorage", "Stored", "active_storage", "reset"]


class Stored:
    """One saved activation as kept: this rank's (possibly offloaded) part and how to rebuild it."""

    __slots__ = ("__weakref__", "data", "device", "dtype", "numel", "partitioned", "shape", "slot")

    def __init__(
        self,
        data: torch.Tensor,
        like: torch.Tensor,
        partitioned: bool,
        slot: Slot | None,
    ) -> None:
        self.data = data
        self.shape = like.shape
        self.dtype = like.dtype
        self.device = like.device
        self.numel = like.numel()
        self.partitioned = partitioned
        self.slot = slot

    @property
    def nbytes(self) -> int:
        """Bytes this rank holds for it."""
        return self.data.numel() * self.data.element_size()


class ActivationStorage:
    """Packs and unpacks saved activations according to one set of settings.

    Raises:
        ConfigError: contiguous memory with no slot count yet (``missing_slot_count``).
    """

    def __init__(self, settings: CheckpointingSettings) -> None:
        self.settings = settings
        self.split = settings.partition_activations and settings.mp_size > 1
        self.pin = settings.cpu_checkpointing and torch.cuda.is_available()
        self.host = torch.device("cpu") if settings.cpu_checkpointing else None
        missing = missing_slot_count(settings)  # initialize left it for a later configure() to give
        if missing is not None:
            raise missing
        self.pool = (
            ContiguousPool(settings.number_checkpoints, self.host, self.pin)
            if settings.contiguous_memory_optimization and settings.number_checkpoints is not None
            else None
        )

    def is_activation(self, tensor: torch.Tensor) -> bool:
        """DeepSpeed's rule: floating point, numel >= model-parallel size, and not a parameter."""
        return (
            tensor.is_floating_point()
            and tensor.numel() >= self.settings.mp_size
            and not isinstance(tensor, torch.nn.Parameter)
            and not getattr(tensor, "no_checkpointing", False)
        )

    def pack(self, tensor: torch.Tensor) -> Any:
        """What is kept for ``tensor`` until backward."""
        if not self.is_activation(tensor):
            return tensor
        flat = tensor.detach().reshape(-1)
        partitioned = self.split
        if partitioned:
            flat = self._my_partition(flat)
        slot = None
        if self.pool is not None:
            slot = self.pool.take(flat)
            data = slot.tensor
        elif self.host is not None and flat.device != self.host:
            data = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=self.pin).copy_(flat)
        else:
            data = flat.clone() if partitioned else tensor.detach()
        stored = Stored(data, tensor, partitioned, slot)
        if slot is not None:
            weakref.finalize(stored, slot.release)  # a graph dropped without backward frees its slot
        record_stored(stored, stored.nbytes)
        return stored

    def unpack(self, stored: Any) -> torch.Tensor:
        """The full activation back on its device."""
        if not isinstance(stored, Stored):
            return stored
        if stored.slot is not None and stored.slot.released:
            raise RuntimeError(
                "a checkpointed activation kept in the contiguous buffer was read twice (backward with "
                "retain_graph=True); turn contiguous_memory_optimization off for such graphs"
            )
        data = stored.data.to(stored.device, non_blocking=self.pin)
        if stored.partitioned:
            data = self._gather(data, stored.numel)
        elif stored.slot is not None and data.data_ptr() == stored.data.data_ptr():
            data = data.clone()  # the slot is given back below
        if stored.slot is not None:
            stored.slot.release()
        return data.view(stored.shape)

    def _my_partition(self, flat: torch.Tensor) -> torch.Tensor:
        size, rank = self.settings.mp_size, self.settings.mp_rank
        per = -(-flat.numel() // size)
        lo, hi = min(rank * per, flat.numel()), min((rank + 1) * per, flat.numel())
        part = torch.zeros(per, dtype=flat.dtype, device=flat.device)
        part[: hi - lo].copy_(flat[lo:hi])
        return part

    def _gather(self, part: torch.Tensor, numel: int) -> torch.Tensor:
        from shardwise.comm.collectives import all_gather_flat

        full = torch.empty(part.numel() * self.settings.mp_size, dtype=part.dtype, device=part.device)
        all_gather_flat(full, part.contiguous(), group=self.settings.mp_group)
        return full[:numel]


_storage: ActivationStorage | None = None


def active_storage() -> ActivationStorage | None:
    """The storage for the current settings, or None when inputs are kept as they are
    (rebuilt whenever ``configure`` changed the settings)."""
    global _storage
    settings = current_settings()
    if not settings.transforms_storage:
        return None
    if _storage is None or _storage.settings is not settings:
        _storage = ActivationStorage(settings)
    return _storage


def reset() -> None:
    """DeepSpeed's ``reset``: drop the contiguous buffers (after forwards without backward).

    Activations still stored keep their own slot views alive, so this is always safe.
    """
    global _storage
    _storage = None
