"""``contiguous_memory_optimization``: saved activation partitions in preallocated buffers.

DeepSpeed copies each checkpoint's partition into a buffer allocated once for
``number_checkpoints`` checkpoints, so the many same-sized saves of a forward do not fragment
the allocator. Here one buffer is allocated per (dtype, device, partition size) the first
time such a partition is stored, with ``number_checkpoints`` slots; a slot is taken at the
checkpoint's forward and given back when backward has read it (or when the graph holding it
is dropped without a backward).

Example:
    >>> import torch
    >>> pool = ContiguousPool(slots=2)
    >>> slot = pool.take(torch.ones(3))
    >>> slot.tensor.tolist(), pool.free_slots(torch.float32, torch.device("cpu"), 3)
    ([1.0, 1.0, 1.0], 1)
    >>> slot.release(); pool.free_slots(torch.float32, torch.device("cpu"), 3)
    2
"""

from __future__ import annotations

import torch

from shardwise.config.errors import ConfigError

__all__ = ["ContiguousPool", "Slot"]

_Key = tuple[torch.dtype, torch.device, int]


class Slot:
    """One taken slot: ``tensor`` is a view of the pool's buffer; ``release`` is idempotent."""

    __slots__ = ("_free", "_index", "released", "tensor")

    def __init__(self, tensor: torch.Tensor, free: list[int], index: int) -> None:
        self.tensor = tensor
        self._free = free
        self._index = index
        self.released = False

    def release(self) -> None:
        """Give the slot back to its buffer."""
        if not self.released:
            self.released = True
            self._free.append(self._index)


class ContiguousPool:
    """Buffers of ``slots`` equal slots, one per (dtype, device, numel) stored.

    Args:
        slots: ``number_checkpoints``.
        device: where buffers live (None: the stored tensor's device).
        pin: allocate host buffers in pinned memory (a GPU exists).
    """

    def __init__(self, slots: int, device: torch.device | None = None, pin: bool = False) -> None:
        self.slots = slots
        self.device = device
        self.pin = pin
        self._buffers: dict[_Key, tuple[torch.Tensor, list[int]]] = {}

    def _buffer(self, key: _Key) -> tuple[torch.Tensor, list[int]]:
        if key not in self._buffers:
            dtype, device, numel = key
            pin = self.pin and device.type == "cpu"
            buffer = torch.empty(self.slots * numel, dtype=dtype, device=device, pin_memory=pin)
            self._buffers[key] = (buffer, list(range(self.slots - 1, -1, -1)))
        return self._buffers[key]

    def take(self, partition: torch.Tensor) -> Slot:
        """Copy a flat ``partition`` into a free slot of its buffer.

        Raises:
            ConfigError: every slot is in use (more checkpoints alive than ``number_checkpoints``).
        """
        device = self.device or partition.device
        numel = partition.numel()
        buffer, free = self._buffer((partition.dtype, device, numel))
        if not free:
            raise ConfigError(
                "activation_checkpointing.number_checkpoints",
                f"more than {self.slots} checkpointed activations of {numel} elements are alive at once "
                "(the contiguous buffer has one slot per checkpoint)",
                "set number_checkpoints to the number of checkpoint() calls per forward times the forwards "
                "run before a backward, or call shardwise.checkpointing.reset() after forwards without backward",
                value=self.slots,
            )
        index = free.pop()
        view = buffer[index * numel : (index + 1) * numel]
        view.copy_(partition.reshape(-1), non_blocking=self.pin)
        return Slot(view, free, index)

    def free_slots(self, dtype: torch.dtype, device: torch.device, numel: int) -> int:
        """Free slots of one buffer (``slots`` before it exists)."""
        entry = self._buffers.get((dtype, device, numel))
        return self.slots if entry is None else len(entry[1])

    def allocated_bytes(self) -> int:
        """Bytes of every buffer allocated so far."""
        return sum(b.numel() * b.element_size() for b, _ in self._buffers.values())
