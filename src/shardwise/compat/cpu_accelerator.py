"""DeepSpeed's CPU accelerator (its ``CPU_Accelerator`` semantics): what ``get_accelerator()`` returns without a GPU.

One ``"cpu"`` device with no index; ``set_device``/``synchronize``/``empty_cache`` are no-ops; streams and
events are ``None`` with a do-nothing ``stream()`` context; memory statistics are the process's resident set
size (and its peak since the last reset); ``device_count`` is ``LOCAL_SIZE`` or the NUMA nodes with cores;
fp16 is "supported" only where oneDNN has fp16 kernels. The base class of ``cuda_accelerator.CudaAccelerator``.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

# What DeepSpeed's accelerator methods take as a device: an index, a name ("cuda:1") or a device.
DeviceIndex = int | str | torch.device | None
T = TypeVar("T")

SUPPORTED_ACCELERATORS = ("cpu", "cuda")
"""The ``DS_ACCELERATOR`` values shardwise runs on (DeepSpeed also lists xpu, npu, mps, hpu, mlu, sdaa)."""


def _resident_bytes() -> int:
    """This process's resident set size in bytes (``/proc/self/statm``; peak RSS where there is no /proc)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


def _total_and_available_bytes() -> tuple[int, int]:
    """Host memory: total and available bytes (``/proc/meminfo``, else ``sysconf``)."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        kib = {
            key: int(value.split()[0]) for key, value in fields.items() if key in ("MemTotal", "MemAvailable")
        }
        return kib["MemTotal"] * 1024, kib["MemAvailable"] * 1024
    except (OSError, KeyError, ValueError):
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_PHYS_PAGES") * page, os.sysconf("SC_AVPHYS_PAGES") * page


def _numa_nodes_with_cores() -> int:
    """How many NUMA nodes have CPUs (sysfs); 1 where that cannot be read."""
    lists = []
    for node in sorted(Path("/sys/devices/system/node").glob("node[0-9]*")):
        with contextlib.suppress(OSError):
            cpus = (node / "cpulist").read_text().strip()
            if cpus and cpus not in lists:
                lists.append(cpus)
    return len(lists) or 1


class CpuAccelerator:
    """DeepSpeed's CPU accelerator: ``_name`` ``"cpu"``, the ``gloo`` backend."""

    _name = "cpu"
    _communication_backend_name = "gloo"

    def __init__(self) -> None:
        self._compile_backend = "inductor"
        self.max_mem = _resident_bytes()

    # device placement
    def is_synchronized_device(self) -> bool:
        """True: CPU work is done when the call returns (no streams to wait for)."""
        return True

    def use_host_timers(self) -> bool:
        """Time with the host clock (no device events)."""
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        """True: no stream synchronisation is needed between producer and consumer."""
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        """True: no device allocator to throttle."""
        return self.is_synchronized_device()

    def device_name(self, device_index: int | str | None = None) -> str:
        """``"cpu"`` (a CPU has no index)."""
        return self._name

    def device(self, device_index: int | None = None) -> Any:
        """``None``: DeepSpeed's CPU accelerator has no device object."""
        return None

    def set_device(self, device_index: int) -> None:
        """No-op on CPU (every rank uses the host)."""

    def current_device(self) -> int:
        """The local rank (``LOCAL_RANK``, 0 when unset)."""
        return int(os.environ.get("LOCAL_RANK", 0))

    def current_device_name(self) -> str:
        """``"cpu"``."""
        return self._name

    def device_count(self) -> int:
        """``LOCAL_SIZE`` when set, else the number of NUMA nodes with cores."""
        local_size = int(os.environ.get("LOCAL_SIZE", 0))
        return local_size if local_size > 0 else _numa_nodes_with_cores()

    def synchronize(self, device_index: DeviceIndex = None) -> None:
        """No-op on CPU."""

    def is_available(self) -> bool:
        """Always true."""
        return True

    # RNG
    def random(self) -> Any:
        """``torch.random``."""
        return torch.random

    def set_rng_state(self, new_state: torch.Tensor, device_index: DeviceIndex = None) -> None:
        """Restore the host generator's state."""
        torch.set_rng_state(new_state)

    def get_rng_state(self, device_index: DeviceIndex = None) -> torch.Tensor:
        """The host generator's state."""
        return torch.get_rng_state()

    def manual_seed(self, seed: int) -> torch.Generator | None:
        """Seed the host generator."""
        return torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> torch.Generator | None:
        """Seed the host generator (there is one)."""
        return torch.manual_seed(seed)

    def initial_seed(self) -> int:
        """The host generator's initial seed."""
        return torch.initial_seed()

    def default_generator(self, device_index: DeviceIndex = None) -> torch.Generator:
        """``torch.default_generator``."""
        return torch.default_generator

    # streams and events: none on CPU
    @property
    def Stream(self) -> Any:
        """``None``: no stream class on CPU."""
        return None

    def stream(self, stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager[object]:
        """A context that does nothing."""
        return contextlib.nullcontext()

    def current_stream(self, device_index: DeviceIndex = None) -> torch.cuda.Stream | None:
        """``None``."""
        return None

    def default_stream(self, device_index: DeviceIndex = None) -> torch.cuda.Stream | None:
        """``None``."""
        return None

    @property
    def Event(self) -> Any:
        """``None``: no event class on CPU."""
        return None

    # memory: the process's resident set size
    def empty_cache(self) -> None:
        """No-op on CPU."""

    def get_rss(self) -> int:
        """Resident bytes now (raises the recorded peak if higher)."""
        self.max_mem = max(self.max_mem, mem := _resident_bytes())
        return mem

    def reset_rss(self) -> int:
        """Reset the recorded peak to the resident bytes now."""
        self.max_mem = _resident_bytes()
        return self.max_mem

    def memory_allocated(self, device_index: DeviceIndex = None) -> int:
        """Resident bytes."""
        return self.get_rss()

    def max_memory_allocated(self, device_index: DeviceIndex = None) -> int:
        """Peak resident bytes since the last reset."""
        self.get_rss()
        return self.max_mem

    def reset_max_memory_allocated(self, device_index: DeviceIndex = None) -> None:
        """Reset the peak."""
        self.reset_rss()

    memory_cached = memory_reserved = memory_allocated
    max_memory_cached = max_memory_reserved = max_memory_allocated
    reset_max_memory_cached = reset_peak_memory_stats = reset_max_memory_allocated

    def memory_stats(self, device_index: DeviceIndex = None) -> dict[str, int]:
        """``allocated_bytes.all.current`` and ``.peak`` (resident bytes)."""
        current = self.get_rss()
        return {"allocated_bytes.all.current": current, "allocated_bytes.all.peak": self.max_mem}

    def total_memory(self, device_index: DeviceIndex = None) -> int:
        """Host memory in bytes."""
        return _total_and_available_bytes()[0]

    def available_memory(self, device_index: DeviceIndex = None) -> int:
        """Host memory available now, in bytes."""
        return _total_and_available_bytes()[1]

    # dtypes
    def is_bf16_supported(self) -> bool:
        """True on CPU."""
        return True

    def is_fp16_supported(self) -> bool:
        """True only where oneDNN has fp16 kernels (DeepSpeed's test; shardwise still trains fp16 elsewhere)."""
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
        except (AttributeError, RuntimeError):
            return False

    def supported_dtypes(self) -> list[torch.dtype]:
        """fp32 and bf16, plus fp16 where :meth:`is_fp16_supported`."""
        return [torch.float, torch.bfloat16, *([torch.float16] if self.is_fp16_supported() else [])]

    def is_triton_supported(self) -> bool:
        """False on CPU."""
        return False

    def amp(self) -> Any:
        """``torch.amp`` (autocast takes the device type)."""
        return torch.amp

    # misc
    def range_push(self, msg: str, domain: object = None, category: object = None) -> None:
        """No-op on CPU (no NVTX)."""

    def range_pop(self, domain: object = None) -> None:
        """No-op on CPU."""

    def lazy_call(self, callback: Callable[[], T]) -> T:
        """Call ``callback`` now."""
        return callback()

    def communication_backend_name(self) -> str:
        """``"gloo"`` on CPU, ``"nccl"`` on CUDA."""
        return self._communication_backend_name

    # graphs: none on CPU
    def create_graph(self) -> torch.cuda.CUDAGraph | None:
        """``None``."""
        return None

    def capture_to_graph(
        self,
        graph: torch.cuda.CUDAGraph,
        pool: object = None,  # torch.cuda.graph_pool_handle(), a private torch type
        stream: torch.cuda.Stream | None = None,
    ) -> contextlib.AbstractContextManager[object]:
        """A context that does nothing."""
        return contextlib.nullcontext()

    def replay_graph(self, graph: torch.cuda.CUDAGraph) -> None:
        """No-op."""

    # tensor types: torch's legacy CPU classes, as DeepSpeed's CPU accelerator
    BFloat16Tensor = property(lambda self: torch.BFloat16Tensor)
    ByteTensor = property(lambda self: torch.ByteTensor)
    DoubleTensor = property(lambda self: torch.DoubleTensor)
    FloatTensor = property(lambda self: torch.FloatTensor)
    HalfTensor = property(lambda self: torch.HalfTensor)
    IntTensor = property(lambda self: torch.IntTensor)
    LongTensor = property(lambda self: torch.LongTensor)

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1, **_: object) -> torch.Tensor:
        """``tensor`` itself: CPU tensors are not pinned to any device."""
        return tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """``tensor.is_pinned()``."""
        return tensor.is_pinned()

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        """True when ``tensor`` lives on this accelerator's device type."""
        return tensor.device.type == self._name

    # op builders (shardwise's are torch-based, see shardwise.compat.op_builder)
    def op_builder_dir(self) -> str:
        """Where the op builders live: ``deepspeed.ops.op_builder``."""
        return "deepspeed.ops.op_builder"

    def get_op_builder(self, class_name: str) -> Any:
        """The op builder class ``class_name`` (``NotImplementedBuilder`` for one shardwise lacks)."""
        from shardwise.compat import op_builder

        return getattr(op_builder, class_name, op_builder.NotImplementedBuilder)

    def create_op_builder(self, class_name: str) -> Any:
        """An instance of :meth:`get_op_builder`'s class."""
        return self.get_op_builder(class_name)()

    def build_extension(self) -> Any:
        """shardwise compiles nothing: raises, naming the torch-based ops instead."""
        raise NotImplementedError(
            "get_accelerator().build_extension() is not provided by shardwise: it builds no C++/CUDA "
            "extensions; its ops are torch-based (deepspeed.ops.op_builder.<Builder>().load())"
        )

    # environment
    def export_envs(self) -> list[str]:
        """Environment prefixes the launcher forwards to other nodes (none for CPU)."""
        return []

    def visible_devices_envs(self) -> list[str]:
        """``["CUDA_VISIBLE_DEVICES"]`` (as DeepSpeed's CPU accelerator)."""
        return ["CUDA_VISIBLE_DEVICES"]

    def set_visible_devices_envs(self, current_env: dict[str, str], local_accelerator_ids: list[int]) -> None:
        """Set each visible-devices variable in ``current_env`` to the comma-joined ids."""
        for name in self.visible_devices_envs():
            current_env[name] = ",".join(map(str, local_accelerator_ids))

    def get_compile_backend(self) -> str:
        """The ``torch.compile`` backend (``"inductor"``)."""
        return self._compile_backend

    def set_compile_backend(self, backend: str) -> None:
        """Choose the ``torch.compile`` backend; an unknown one raises naming the known ones."""
        known = torch._dynamo.list_backends(exclude_tags=())
        if backend not in known:
            raise ValueError(
                f"set_compile_backend({backend!r}): not a torch.compile backend on {self.device_name()}; known: {known}"
            )
        self._compile_backend = backend
