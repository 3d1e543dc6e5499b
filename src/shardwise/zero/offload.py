"""Optimizer offload: the optimizer step runs on host tensors, its state lives on the host or in files.

``offload_optimizer`` (stages 1, 2 and 3) moves optimizer state off the accelerator. The
device keeps what forward and backward need (the parameters, and the fp32 masters ZeRO
already holds: the flat shards at stages 1-2, FSDP2's sharded fp32 parameters at stage
3); :class:`OffloadStore` holds the optimizer's view of them:

- ``device: cpu``: host staging copies of the offloaded masters and their gradients
  (pinned when a GPU exists and ``pin_memory`` is set), and the optimizer state next to
  them in host memory;
- ``device: nvme``: the optimizer state in a swap file under ``nvme_path``; between steps
  no state is in memory. During the step, sub-groups of ``sub_group_size`` elements are
  streamed in, stepped and streamed out; with ``pipeline_read`` (or ``aio.overlap_events``)
  the next sub-groups are read while one steps, with ``pipeline_write`` a sub-group is
  written back while the next steps, never more than ``buffer_count`` sub-groups resident.

Every step copies gradients and masters device -> host, steps, and copies the masters
back, so the device copy stays the one truth (a checkpoint load or a broadcast that
writes the device masters needs no extra sync). ``ratio`` < 1 offloads only the first
``ratio`` of the elements; the rest step on the device in the same optimizer call order.

:class:`~shardwise.zero.offloaded_optimizer.OffloadedOptimizer` wraps the inner torch optimizer so ZeRO calls it as before
(``step``, ``param_groups``, ``state``, ``state_dict``). On a CPU-only machine "device"
and "host" are both the CPU: the copies, sub-groups and files all still run.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from shardwise.zero.memory_plan import offloaded_prefix
from shardwise.zero.nvme import IoHandle, SwapFile, remove_directory, swap_directory
from shardwise.zero.offload_spec import OffloadSpec
from shardwise.zero.offload_spec import optimizer_offload_spec as optimizer_offload_spec  # re-exported
from shardwise.zero.offload_spec import param_offload_spec as param_offload_spec
from shardwise.zero.offloaded_optimizer import OffloadedOptimizer, checkpoint_view
from shardwise.zero.optimizer_subset import restricted, split_sub_groups

__all__ = [
    "OffloadSpec",
    "OffloadStore",
    "OffloadedOptimizer",
    "checkpoint_view",
    "offloaded_prefix",
    "split_sub_groups",
]


class Waitable(Protocol):
    """Something in flight (an :class:`IoHandle` or a companion's transfer)."""

    def wait(self) -> None: ...


class StreamCompanion(Protocol):
    """Tensors a streamed sub-group needs in memory besides its optimizer state (by index into
    the store's ``device_tensors``): brought in before the sub-group steps, written out after."""

    def load(self, indices: Sequence[int]) -> Sequence[Waitable]: ...

    def save(self, indices: Sequence[int]) -> Sequence[Waitable]: ...


@dataclass
class _Slot:
    offset: int
    shape: torch.Size
    dtype: torch.dtype


class OffloadStore:
    """Host (or file) side of the optimizer for a list of device master tensors.

    Args:
        device_groups: param groups whose ``params`` are the device masters (their
            ``.grad`` holds the gradient to apply at step time).
        spec: the offload block.
        rank: this rank (names the swap directory).
        tag: distinguishes several stores of one rank (``"optimizer"``).
    """

    def __init__(
        self,
        device_groups: Sequence[dict[str, Any]],
        spec: OffloadSpec,
        rank: int = 0,
        tag: str = "optimizer",
    ) -> None:
        self.spec = spec
        self.device_tensors: list[torch.Tensor] = [t for g in device_groups for t in g["params"]]
        numels = [t.numel() for t in self.device_tensors]
        self.offloaded = offloaded_prefix(numels, spec.ratio)
        staged = not spec.masters_on_host
        self.host: list[torch.Tensor] = []
        self._host_grads: list[torch.Tensor | None] = []
        for index, tensor in enumerate(self.device_tensors):
            if index < self.offloaded and staged:
                host = self._host_buffer(tensor)
                if spec.device != "nvme":
                    host.copy_(tensor.detach())
                self.host.append(host)
                self._host_grads.append(None)  # allocated at the first step
            else:
                self.host.append(tensor)
                self._host_grads.append(None)
        self.host_groups: list[dict[str, Any]] = []
        position = 0
        for group in device_groups:
            count = len(group["params"])
            hyper = {k: v for k, v in group.items() if k != "params"}
            self.host_groups.append({**hyper, "params": self.host[position : position + count]})
            position += count
        self.sub_groups = split_sub_groups(numels[: self.offloaded], spec.sub_group_size)
        # what else a sub-group needs in memory while it steps (stage 3's NVMe parameter swapper:
        # the masters themselves): ``load(indices)``/``save(indices)`` return things to ``wait()`` on
        self.companion: StreamCompanion | None = None
        self._staged = staged
        self._file: SwapFile | None = None
        self._slots: dict[tuple[int, str], _Slot] = {}
        self._directory: Path | None = None
        if spec.device == "nvme":
            assert spec.nvme_path is not None, "nvme offload without nvme_path (the config validates this)"
            self._directory = swap_directory(spec.nvme_path, tag, rank)
            self._file = SwapFile(self._directory, "state", spec.aio)
            # the files go with the store, even if nobody calls close()
            self._finalizer = weakref.finalize(self, remove_directory, self._directory)
            for index in range(self.offloaded):
                if self.host[index] is not self.device_tensors[index]:
                    # nothing stays in memory with nvme: staging copies are filled per sub-group
                    self.host[index].untyped_storage().resize_(0)

    # ------------------------------------------------------------------ buffers
    def _host_buffer(self, like: torch.Tensor) -> torch.Tensor:
        # pinned at allocation: ``Tensor.pin_memory()`` returns a storage that cannot be resized, and
        # NVMe staging buffers are freed and refilled with ``resize_`` between steps
        return torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=self.spec.pin)

    @property
    def is_nvme(self) -> bool:
        """True when the optimizer state lives in a swap file."""
        return self._file is not None

    @property
    def swap_path(self) -> Path | None:
        """The swap file (nvme), for inspection."""
        return None if self._file is None else self._file.path

    # ------------------------------------------------------------------ the step
    def _stage_in(self, indices: Sequence[int]) -> None:
        """Device -> host: masters and gradients of these tensors."""
        for index in indices:
            device = self.device_tensors[index]
            host = self.host[index]
            grad = device.grad
            if host is device:
                continue
            host.copy_(device.detach(), non_blocking=True)
            if grad is None:
                host.grad = None
                continue
            buf = self._host_grads[index]
            if buf is None or buf.dtype != grad.dtype:
                buf = self._host_buffer(grad)
                self._host_grads[index] = buf
            buf.copy_(grad, non_blocking=True)
            host.grad = buf
        if self.spec.pin:
            torch.cuda.current_stream().synchronize()

    def _stage_out(self, indices: Sequence[int]) -> None:
        """Host -> device: updated masters."""
        for index in indices:
            device, host = self.device_tensors[index], self.host[index]
            if host is not device:
                with torch.no_grad():
                    device.copy_(host, non_blocking=True)
                host.grad = None
        if self.spec.pin:
            torch.cuda.current_stream().synchronize()  # host buffers may be reused or freed next

    _restricted = staticmethod(restricted)  # step only some tensors (zero.optimizer_subset)

    def _step_subset(self, optimizer: torch.optim.Optimizer, indices: Sequence[int]) -> None:
        if not indices:
            return
        members = {id(self.host[i]) for i in indices}
        with self._restricted(optimizer, members):
            optimizer.step()

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """One optimizer step over all tensors: device part in place, offloaded part on the host."""
        device_part = list(range(self.offloaded, len(self.device_tensors)))
        self._step_subset(optimizer, device_part)
        if not self.is_nvme:
            indices = list(range(self.offloaded))
            self._stage_in(indices)
            for group in self.sub_groups:
                self._step_subset(optimizer, group)
            self._stage_out(indices)
            return
        self._stream_step(optimizer)

    def _stream_step(self, optimizer: torch.optim.Optimizer) -> None:
        """NVMe: per sub-group, read state, stage in, step, stage out, write state, evict."""
        ahead = self.spec.pipeline_read or self.spec.aio.overlap_events
        window = max(1, self.spec.buffer_count)
        reads: dict[int, list[Waitable]] = {}
        writes: list[tuple[int, list[Waitable]]] = []

        def start_read(g: int) -> None:
            if g < len(self.sub_groups) and g not in reads:
                indices = self.sub_groups[g]
                companion = [] if self.companion is None else self.companion.load(indices)
                reads[g] = [*self._load_state(optimizer, indices), *companion]

        for g, indices in enumerate(self.sub_groups):
            start_read(g)
            if ahead:
                for nxt in range(g + 1, min(len(self.sub_groups), g + window)):
                    if len(reads) + len(writes) >= window:
                        break
                    start_read(nxt)
            for handle in reads.pop(g):
                handle.wait()  # the state, and the companion's tensors, are in memory
            self._restore_staging(indices)
            self._stage_in(indices)
            self._step_subset(optimizer, indices)
            self._stage_out(indices)
            handles: list[Waitable] = [*self._save_state(optimizer, indices)]
            if self.companion is not None:
                handles.extend(self.companion.save(indices))
            if self.spec.pipeline_write:
                writes.append((g, handles))
                while len(writes) + len(reads) > window:
                    self._finish_write(optimizer, *writes.pop(0))
            else:
                self._finish_write(optimizer, g, handles)
        for g, handles in writes:
            self._finish_write(optimizer, g, handles)
        self._release_host_staging()

    def _release_host_staging(self) -> None:
        """NVMe keeps nothing between steps: drop the gradient staging buffers."""
        self._host_grads = [None] * len(self._host_grads)

    # ------------------------------------------------------------------ state files
    def _state_tensors(self, optimizer: torch.optim.Optimizer, index: int) -> dict[str, torch.Tensor]:
        state = optimizer.state.get(self.host[index], {})
        return {k: v for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0 and v.numel() > 0}

    def _load_state(self, optimizer: torch.optim.Optimizer, indices: Sequence[int]) -> list[IoHandle]:
        assert self._file is not None
        handles = []
        for index in indices:
            state = optimizer.state.get(self.host[index])
            if not state:
                continue  # first step: the optimizer creates the state
            for (i, key), slot in self._slots.items():
                if i != index:
                    continue
                buf = self._host_buffer_of(slot)
                handles.append(self._file.read(buf, slot.offset))
                state[key] = buf
        return handles

    def _host_buffer_of(self, slot: _Slot) -> torch.Tensor:
        return torch.empty(slot.shape, dtype=slot.dtype, device="cpu", pin_memory=self.spec.pin)

    def _save_state(self, optimizer: torch.optim.Optimizer, indices: Sequence[int]) -> list[IoHandle]:
        assert self._file is not None
        handles = []
        for index in indices:
            for key, tensor in self._state_tensors(optimizer, index).items():
                slot = self._slots.get((index, key))
                if slot is None:
                    nbytes = tensor.numel() * tensor.element_size()
                    slot = _Slot(self._file.allocate(nbytes), tensor.shape, tensor.dtype)
                    self._slots[(index, key)] = slot
                tensor = tensor if tensor.device.type == "cpu" else tensor.cpu()
                handles.append(self._file.write(tensor.contiguous(), slot.offset))
        return handles

    def _finish_write(self, optimizer: torch.optim.Optimizer, g: int, handles: Sequence[Waitable]) -> None:
        for handle in handles:
            handle.wait()
        for index in self.sub_groups[g]:
            state = optimizer.state.get(self.host[index])
            if not state:
                continue
            for key in list(state):
                if (index, key) in self._slots:
                    slot = self._slots[(index, key)]
                    # an empty placeholder keeps the state's keys (so the optimizer does
                    # not re-initialise it); the values live in the file until the next load
                    state[key] = torch.empty(0, dtype=slot.dtype)
            host = self.host[index]
            if self._staged and host is not self.device_tensors[index]:
                host.untyped_storage().resize_(0)  # the staging copy is refilled next step
        if self._staged:
            for index in self.sub_groups[g]:
                self._host_grads[index] = None

    def _restore_staging(self, indices: Sequence[int]) -> None:
        for index in indices:
            host = self.host[index]
            if host is not self.device_tensors[index] and host.untyped_storage().nbytes() == 0:
                host.untyped_storage().resize_(host.numel() * host.element_size())

    # ------------------------------------------------------------------ whole-state access
    @contextlib.contextmanager
    def resident_state(self, optimizer: torch.optim.Optimizer) -> Iterator[None]:
        """All optimizer state in memory inside the block (for state_dict / load); nvme only."""
        if not self.is_nvme:
            yield
            return
        indices = list(range(self.offloaded))
        self._restore_staging(indices)
        for handle in self._load_state(optimizer, indices):
            handle.wait()
        try:
            yield
        finally:
            for g in range(len(self.sub_groups)):
                self._finish_write(optimizer, g, self._save_state(optimizer, self.sub_groups[g]))

    def state_snapshot(self, optimizer: torch.optim.Optimizer) -> dict[int, dict[str, Any]]:
        """Every tensor's optimizer state in memory, keyed by ``id(host tensor)``, leaving the
        optimizer as it is (nvme: the file's values are read into fresh buffers)."""
        out: dict[int, dict[str, Any]] = {}
        handles: list[IoHandle] = []
        for index, host in enumerate(self.host):
            state = dict(optimizer.state.get(host, {}))
            if self._file is not None and index < self.offloaded and state:
                for (i, key), slot in self._slots.items():
                    if i == index:
                        buf = torch.empty(slot.shape, dtype=slot.dtype, device="cpu")
                        handles.append(self._file.read(buf, slot.offset))
                        state[key] = buf
            if state:
                out[id(host)] = state
        for handle in handles:
            handle.wait()
        return out

    def state_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Bytes this store holds: ``host`` (staging buffers and in-memory state) and ``nvme``."""
        host = 0
        seen: set[int] = set()

        def add(t: torch.Tensor | None) -> None:
            nonlocal host
            if t is None:
                return
            storage = t.untyped_storage()
            if storage.data_ptr() in seen or storage.nbytes() == 0:
                return
            seen.add(storage.data_ptr())
            host += storage.nbytes()

        device_ptrs = {t.untyped_storage().data_ptr() for t in self.device_tensors}
        for index in range(self.offloaded):
            h = self.host[index]
            if h.untyped_storage().data_ptr() not in device_ptrs:
                add(h)
            add(self._host_grads[index])
            for value in optimizer.state.get(h, {}).values():
                if torch.is_tensor(value) and value.dim() > 0:
                    add(value)
        nvme = self._file.nbytes if self._file is not None else 0
        return {"host": host, "nvme": nvme}

    def close(self) -> None:
        """Delete swap files."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._directory is not None:
            self._finalizer()  # removes the directory, once
            self._directory = None
