"""Moving a ZeRO strategy's states to host memory and back (DeepSpeed's ``offload_states`` /
``reload_states``), bit for bit.

Between phases that do not train (RLHF generation, evaluation), a script frees accelerator memory
with ``engine.offload_states(include=[...])`` and brings the states back with ``engine.reload_states()``.
The states are named as DeepSpeed names them (:class:`OffloadStateType`); each strategy says which of
its tensors hold each one (``held_states()``: :mod:`shardwise.zero.state_tensors`).

How a state moves, the same on every device: its tensors are grouped by the storage they live in
(a flat buffer and every view into it share one storage). Each storage is copied byte for byte into a
host buffer (page-locked with ``pin_memory`` when it comes from an accelerator), every tensor the
strategy holds into it is pointed at the same place of the host copy (so it reads, on the host, the
values it had), and the device storage is shrunk to nothing, which frees its memory. ``reload``
grows each storage back, copies the bytes in and points the tensors back at it. References the
strategy does not list (FSDP2's own handles on a shard, a reducer's views) keep the storage object
itself, so they are valid again after the reload: nothing is rebuilt, nothing re-linked.

Shared-memory storages (the CPU transports' segments, mapped by every rank of the host) are copied
and the tensors pointed at the copy, but the segment is not shrunk: it is host memory already and
other ranks map it.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from shardwise.utils.logging import logger

__all__ = ["OffloadDevice", "OffloadStateType", "StateOffloader", "StateOffloading"]


class OffloadStateType(str, Enum):
    """The states ``offload_states`` moves, by DeepSpeed's names.

    ``optim_states``: the optimizer's state (Adam's moments). ``hp_params``: the fp32 master weights
    this rank steps. ``lp_params``: the parameters as the model holds them (its shard at stage 3).
    ``lp_grads``: the accumulated gradients (between ``backward`` and ``step``). ``contiguous_grad_buffer``:
    DeepSpeed's stage-3 reduction bucket; shardwise's reduction buffers live only during a reduction, so
    at stage 3 it is recorded as offloaded with nothing to move, and stages 0-2 do not have it (as in DeepSpeed).
    """

    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"


class OffloadDevice(str, Enum):
    """Where ZeRO offloads to (``offload_optimizer.device``, ``offload_states(device=...)``)."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


@dataclass
class _MovedStorage:
    """One storage moved to the host: the storage (shrunk unless shared), its host copy, and the
    tensors pointed at the copy with the place each had (``storage_offset, size, stride``)."""

    original: torch.UntypedStorage
    host: torch.UntypedStorage
    nbytes: int
    freed: bool
    tensors: list[tuple[torch.Tensor, int, torch.Size, tuple[int, ...]]] = field(default_factory=list)


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """The whole storage as a 1-D ``uint8`` tensor (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _placed(
    storage: torch.UntypedStorage, like: torch.Tensor, offset: int, size: torch.Size, stride: tuple[int, ...]
) -> torch.Tensor:
    """A tensor of ``like``'s dtype at ``(offset, size, stride)`` of ``storage``."""
    return torch.empty(0, dtype=like.dtype, device=storage.device).set_(storage, offset, size, stride)


def _synchronize(device: torch.device) -> None:
    """Wait for the copies queued on an accelerator (none to wait for on the CPU)."""
    if device.type != "cpu" and torch.accelerator.is_available():
        torch.accelerator.synchronize(device)


def _freeable(storage: torch.UntypedStorage) -> bool:
    """Whether the storage may be shrunk: a CPU storage unless it is a shared-memory segment (other ranks
    map it; ``is_shared`` says so on the CPU only: it is True for every CUDA storage), an accelerator
    storage when its allocator lets it resize (the caching allocator's do; FSDP2 resizes them too)."""
    if storage.device.type == "cpu":
        return not storage.is_shared()
    return bool(storage.resizable())


class StateOffloader:
    """The storages one strategy moved to the host, and the state names offloaded."""

    def __init__(self) -> None:
        self._moved: dict[int, _MovedStorage] = {}  # key: the host copy's data_ptr
        self.offloaded: set[OffloadStateType] = set()

    def is_offloaded(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives in a host copy this offloader made."""
        storage = tensor.untyped_storage()
        return storage.nbytes() > 0 and storage.data_ptr() in self._moved

    def offload(
        self,
        held: Mapping[OffloadStateType, Sequence[torch.Tensor]],
        include: Iterable[OffloadStateType],
        *,
        pin_memory: bool,
        non_blocking: bool,
    ) -> None:
        """Move the storages of the ``include`` states' tensors to the host; every tensor of ``held``
        (all states) that lives in a moved storage is pointed at the host copy. A state ``held`` has
        no key for is not the strategy's: it is not recorded as offloaded."""
        wanted = [kind for kind in include if kind not in self.offloaded and kind in held]
        storages: dict[int, torch.UntypedStorage] = {}
        for kind in wanted:
            for tensor in held.get(kind, ()):
                storage = tensor.untyped_storage()
                if (
                    storage.nbytes() > 0
                    and storage.device.type != "meta"
                    and storage.data_ptr() not in self._moved
                ):
                    storages.setdefault(storage.data_ptr(), storage)
        copies: dict[int, _MovedStorage] = {}
        for key, storage in storages.items():
            pin = pin_memory and storage.device.type != "cpu"
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, device="cpu", pin_memory=pin)
            host.copy_(_bytes_of(storage), non_blocking=non_blocking)
            copies[key] = _MovedStorage(storage, host.untyped_storage(), storage.nbytes(), freed=False)
        self._repoint(held, copies)
        for device in {moved.original.device for moved in copies.values()}:
            _synchronize(device)  # the device storages are freed next: their copies must be done
        for moved in copies.values():
            if _freeable(moved.original):
                moved.original.resize_(0)
                moved.freed = True
            self._moved[moved.host.data_ptr()] = moved
        self.offloaded.update(wanted)

    @staticmethod
    def _repoint(
        held: Mapping[OffloadStateType, Sequence[torch.Tensor]], copies: Mapping[int, _MovedStorage]
    ) -> None:
        """Point every held tensor of a copied storage at the same place of the host copy."""
        seen: set[int] = set()
        for tensors in held.values():
            for tensor in tensors:
                moved = (
                    copies.get(tensor.untyped_storage().data_ptr())
                    if tensor.untyped_storage().nbytes()
                    else None
                )
                if moved is None or id(tensor) in seen:
                    continue
                seen.add(id(tensor))
                offset, size, stride = int(tensor.storage_offset()), tensor.size(), tuple(tensor.stride())
                moved.tensors.append((tensor, offset, size, stride))
                tensor.data = _placed(moved.host, tensor, offset, size, stride)

    def reload(self, *, non_blocking: bool) -> None:
        """Every moved storage back where it was, with the host copy's bytes; the tensors pointed back."""
        devices = set()
        for moved in self._moved.values():
            if moved.freed:
                moved.original.resize_(moved.nbytes)
            _bytes_of(moved.original).copy_(_bytes_of(moved.host), non_blocking=non_blocking)
            for tensor, offset, size, stride in moved.tensors:
                tensor.data = _placed(moved.original, tensor, offset, size, stride)
            devices.add(moved.original.device)
        for device in devices:
            _synchronize(device)  # the host copies are dropped next: the copies out of them must be done
        self._moved.clear()
        self.offloaded.clear()


class StateOffloading:
    """``offload_states`` / ``reload_states`` for a ZeRO strategy (mixed into both strategies).

    The strategy provides ``held_states()`` (its tensors per state name), ``host_states()`` (the
    states its config already keeps on the host, e.g. with ``offload_optimizer``) and
    ``offload_refusal()`` (why it cannot move its states; empty when it can).
    """

    @abstractmethod
    def held_states(self) -> dict[OffloadStateType, list[torch.Tensor]]:
        """The tensors that hold each state now."""

    def host_states(self) -> frozenset[OffloadStateType]:
        """The states the config keeps on the host already (left out of ``offload_states``)."""
        return frozenset()

    def offload_refusal(self) -> str:
        """Why the states cannot be moved (empty: they can)."""
        return ""

    def prepare_offload(self) -> None:
        """Make ``held_states`` complete before a move (e.g. free gathered copies, collect gradients)."""

    @property
    def state_offloader(self) -> StateOffloader:
        """The storages moved so far (created at the first use)."""
        offloader: StateOffloader | None = self.__dict__.get("_state_offloader")
        if offloader is None:
            offloader = self.__dict__["_state_offloader"] = StateOffloader()
        return offloader

    @property
    def offloaded_states(self) -> set[OffloadStateType]:
        """The states ``offload_states`` moved and no ``reload_states`` brought back (DeepSpeed's name)."""
        return self.state_offloader.offloaded

    def offload_states(
        self,
        include: Iterable[OffloadStateType | str] | None = None,
        device: OffloadDevice | str = OffloadDevice.cpu,
        pin_memory: bool = True,
        non_blocking: bool = False,
    ) -> None:
        """Move the ``include`` states (default: all) to ``device`` (only ``"cpu"``)."""
        refusal = self.offload_refusal()
        if refusal:
            raise RuntimeError(f"offload_states() is not possible here: {refusal}")
        target = OffloadDevice(device)
        if target is OffloadDevice.none:
            logger.warning(
                "offload_states(device='none'): no device to move the states to; nothing moved (as DeepSpeed)"
            )
            return
        if target is not OffloadDevice.cpu:
            raise ValueError(
                f"offload_states(device={target.value!r}): states can only be moved to 'cpu' "
                "(OffloadDeviceEnum.cpu); NVMe is for offload_optimizer/offload_param in the config"
            )
        kinds = _state_types(include)
        kinds = [kind for kind in kinds if kind not in self.host_states()]
        self.prepare_offload()
        self.state_offloader.offload(
            self.held_states(), kinds, pin_memory=pin_memory, non_blocking=non_blocking
        )

    def reload_states(self, non_blocking: bool = False) -> None:
        """Bring every offloaded state back to where it was, bit for bit."""
        self.state_offloader.reload(non_blocking=non_blocking)


def get_state_devices(model: Any, state: OffloadStateType | str) -> set[torch.device]:
    """The devices the tensors holding ``state`` are on, for an engine (``model.optimizer``, its ZeRO
    strategy) or a strategy (DeepSpeed's ``deepspeed.runtime.zero.offload_states.get_state_devices``).
    Empty when the strategy holds no tensor for it (``contiguous_grad_buffer``; gradients after a step)."""
    strategy = getattr(model, "optimizer", model)
    if not isinstance(strategy, StateOffloading):
        raise TypeError(
            f"get_state_devices needs an engine with a ZeRO strategy or the strategy itself, got {type(model).__name__}"
        )
    held = strategy.held_states().get(OffloadStateType(state), [])
    return {tensor.device for tensor in held}


def _state_types(include: Iterable[OffloadStateType | str] | None) -> list[OffloadStateType]:
    """``include`` as state types (None: all), an unknown name refused with the valid ones."""
    if include is None:
        return list(OffloadStateType)
    kinds = []
    for item in include:
        try:
            kinds.append(OffloadStateType(item))
        except ValueError:
            valid = ", ".join(kind.value for kind in OffloadStateType)
            raise ValueError(
                f"offload_states(include=...): {item!r} is not a state name; use OffloadStateTypeEnum members ({valid})"
            ) from None
    return kinds
