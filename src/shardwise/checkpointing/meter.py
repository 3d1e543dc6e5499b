"""Bytes held by saved activations, measured with ``torch.autograd.graph.saved_tensors_hooks``.

:class:`SavedActivationMeter` counts, while it is active, every tensor autograd saves for
backward (each storage once, parameters excluded) from the moment it is saved until the
graph lets it go, and keeps the peak. Saves made under an inner ``saved_tensors_hooks``
(as the checkpoint storage installs) are invisible to an outer one, so the storage reports
what it keeps through :func:`record_stored` and the meter adds it.

This module imports only torch (the benchmarks load it by path in a DeepSpeed environment).

Example:
    >>> import torch
    >>> w = torch.nn.Parameter(torch.ones(4, 4))
    >>> with SavedActivationMeter(exclude=[w]) as meter:
    ...     y = (torch.ones(2, 4, requires_grad=True) @ w).sum()
    >>> meter.peak_bytes  # the (2, 4) input; the weight is a parameter
    32
"""

from __future__ import annotations

from collections.abc import Iterable
from types import TracebackType
from typing import Any

import torch

__all__ = ["SavedActivationMeter", "record_stored"]

_ACTIVE: list[SavedActivationMeter] = []


class _Counted:
    """What the meter's pack hook keeps: the tensor, and a release when the graph drops it."""

    __slots__ = ("key", "meter", "tensor")

    def __init__(self, meter: SavedActivationMeter, tensor: torch.Tensor, key: int | None) -> None:
        self.meter = meter
        self.tensor = tensor
        self.key = key

    def __del__(self) -> None:
        if self.key is not None:
            self.meter._drop(self.key)


def record_stored(owner: object, nbytes: int) -> None:
    """Count ``nbytes`` in every active meter until ``owner`` is garbage collected."""
    import weakref

    for meter in _ACTIVE:
        meter._add_external(nbytes)
        weakref.finalize(owner, meter._add_external, -nbytes)


def _storage_ptr(tensor: torch.Tensor) -> int:
    """The storage address, or 0 for tensors without a plain storage (sharded DTensors, freed)."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    try:
        return int(local.untyped_storage().data_ptr())
    except RuntimeError:
        return 0


class SavedActivationMeter:
    """Current and peak bytes of saved activations (a context manager; hooks active inside).

    Args:
        exclude: parameters (or any tensors) whose storage is not counted.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._excluded = {ptr for ptr in map(_storage_ptr, exclude) if ptr}
        self._refs: dict[int, list[int]] = {}  # storage ptr -> [refcount, nbytes]
        self.current_bytes = 0
        self.peak_bytes = 0
        self._hooks: Any = None

    def _pack(self, tensor: torch.Tensor) -> _Counted:
        if isinstance(tensor, torch.nn.Parameter):
            return _Counted(self, tensor, None)
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self._excluded or storage.nbytes() == 0:
            return _Counted(self, tensor, None)
        entry = self._refs.get(key)
        if entry is None:
            self._refs[key] = [1, storage.nbytes()]
            self._move(storage.nbytes())
        else:
            entry[0] += 1
        return _Counted(self, tensor, key)

    @staticmethod
    def _unpack(counted: _Counted) -> torch.Tensor:
        return counted.tensor

    def _drop(self, key: int) -> None:
        entry = self._refs.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            del self._refs[key]
            self._move(-entry[1])

    def _add_external(self, nbytes: int) -> None:
        self._move(nbytes)

    def _move(self, delta: int) -> None:
        self.current_bytes += delta
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)

    def reset_peak(self) -> None:
        """Start a new peak from the current level."""
        self.peak_bytes = self.current_bytes

    def __enter__(self) -> SavedActivationMeter:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        _ACTIVE.append(self)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        _ACTIVE.remove(self)
        self._hooks.__exit__(exc_type, exc, tb)
