"""DeepSpeed's CUDA accelerator over ``torch.cuda``: what ``get_accelerator()`` returns when torch sees a GPU."""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch

from shardwise.compat.cpu_accelerator import CpuAccelerator, DeviceIndex


class CudaAccelerator(CpuAccelerator):
    """DeepSpeed's CUDA accelerator: ``torch.cuda`` under DeepSpeed's method names, ``nccl``."""

    _name = "cuda"
    _communication_backend_name = "nccl"

    def is_synchronized_device(self) -> bool:
        """False: CUDA work is queued on streams."""
        return False

    def device_name(self, device_index: int | str | None = None) -> str:
        """``"cuda"`` or ``"cuda:N"``."""
        return self._name if device_index is None else f"{self._name}:{device_index}"

    def device(self, device_index: int | None = None) -> Any:
        """``torch.cuda.device(device_index)``."""
        return torch.cuda.device(device_index)

    def set_device(self, device_index: int) -> None:
        """``torch.cuda.set_device``."""
        torch.cuda.set_device(device_index)

    def current_device(self) -> int:
        """``torch.cuda.current_device()``."""
        return torch.cuda.current_device()

    def current_device_name(self) -> str:
        """``"cuda:N"`` for the current device."""
        return self.device_name(torch.cuda.current_device())

    def device_count(self) -> int:
        """GPUs visible."""
        return torch.cuda.device_count()

    def synchronize(self, device_index: DeviceIndex = None) -> None:
        """``torch.cuda.synchronize``."""
        torch.cuda.synchronize(device_index)

    def random(self) -> Any:
        """``torch.cuda.random``."""
        return torch.cuda.random

    def set_rng_state(self, new_state: torch.Tensor, device_index: DeviceIndex = None) -> None:
        """Restore a GPU generator's state."""
        torch.cuda.set_rng_state(new_state, "cuda" if device_index is None else device_index)

    def get_rng_state(self, device_index: DeviceIndex = None) -> torch.Tensor:
        """A GPU generator's state."""
        return torch.cuda.get_rng_state("cuda" if device_index is None else device_index)

    def manual_seed(self, seed: int) -> torch.Generator | None:
        """Seed the current GPU's generator."""
        torch.cuda.manual_seed(seed)
        return None

    def manual_seed_all(self, seed: int) -> torch.Generator | None:
        """Seed every GPU's generator."""
        torch.cuda.manual_seed_all(seed)
        return None

    def initial_seed(self) -> int:
        """The current GPU generator's initial seed."""
        return torch.cuda.initial_seed()

    def default_generator(self, device_index: DeviceIndex = None) -> torch.Generator:
        """A GPU's default generator."""
        if isinstance(device_index, (str, torch.device)):
            device_index = torch.device(device_index).index
        return torch.cuda.default_generators[device_index or 0]

    Stream = property(lambda self: torch.cuda.Stream)
    Event = property(lambda self: torch.cuda.Event)

    def stream(self, stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager[object]:
        """``torch.cuda.stream(stream)``."""
        return torch.cuda.stream(stream)

    def current_stream(self, device_index: DeviceIndex = None) -> torch.cuda.Stream | None:
        """``torch.cuda.current_stream``."""
        return torch.cuda.current_stream(device_index)

    def default_stream(self, device_index: DeviceIndex = None) -> torch.cuda.Stream | None:
        """``torch.cuda.default_stream``."""
        return torch.cuda.default_stream(device_index)

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache``."""
        torch.cuda.empty_cache()

    def memory_allocated(self, device_index: DeviceIndex = None) -> int:
        """Bytes held by tensors."""
        return torch.cuda.memory_allocated(device_index)

    def max_memory_allocated(self, device_index: DeviceIndex = None) -> int:
        """Peak bytes held by tensors."""
        return torch.cuda.max_memory_allocated(device_index)

    def reset_max_memory_allocated(self, device_index: DeviceIndex = None) -> None:
        """Reset the tensor peak."""
        torch.cuda.reset_peak_memory_stats(device_index)

    def memory_reserved(self, device_index: DeviceIndex = None) -> int:
        """Bytes held by the caching allocator."""
        return torch.cuda.memory_reserved(device_index)

    def max_memory_reserved(self, device_index: DeviceIndex = None) -> int:
        """Peak bytes held by the caching allocator."""
        return torch.cuda.max_memory_reserved(device_index)

    memory_cached, max_memory_cached = memory_reserved, max_memory_reserved
    reset_max_memory_cached = reset_peak_memory_stats = reset_max_memory_allocated

    def memory_stats(self, device_index: DeviceIndex = None) -> dict[str, Any]:
        """``torch.cuda.memory_stats``."""
        return torch.cuda.memory_stats(device_index)

    def total_memory(self, device_index: DeviceIndex = None) -> int:
        """The GPU's memory in bytes."""
        return torch.cuda.get_device_properties(device_index or 0).total_memory

    def available_memory(self, device_index: DeviceIndex = None) -> int:
        """Free GPU memory in bytes."""
        return torch.cuda.mem_get_info(device_index)[0]

    def is_bf16_supported(self) -> bool:
        """As torch reports for the device."""
        return torch.cuda.is_bf16_supported()

    def is_fp16_supported(self) -> bool:
        """True on every CUDA device torch runs on."""
        return True

    def supported_dtypes(self) -> list[torch.dtype]:
        """fp32, fp16, and bf16 where supported."""
        return [torch.float, torch.half, *([torch.bfloat16] if self.is_bf16_supported() else [])]

    def range_push(self, msg: str, domain: object = None, category: object = None) -> None:
        """An NVTX range."""
        torch.cuda.nvtx.range_push(msg)

    def range_pop(self, domain: object = None) -> None:
        """End the NVTX range."""
        torch.cuda.nvtx.range_pop()

    def create_graph(self) -> torch.cuda.CUDAGraph | None:
        """A ``torch.cuda.CUDAGraph``."""
        return torch.cuda.CUDAGraph()

    def capture_to_graph(
        self,
        graph: torch.cuda.CUDAGraph,
        pool: Any = None,  # torch.cuda.graph_pool_handle(), a private torch type
        stream: torch.cuda.Stream | None = None,
    ) -> contextlib.AbstractContextManager[object]:
        """``torch.cuda.graph(graph, pool, stream)``."""
        return torch.cuda.graph(graph, pool, stream)

    def replay_graph(self, graph: torch.cuda.CUDAGraph) -> None:
        """``graph.replay()``."""
        graph.replay()

    BFloat16Tensor = property(
        lambda self: functools.partial(torch.tensor, dtype=torch.bfloat16, device="cuda")
    )
    ByteTensor = property(lambda self: functools.partial(torch.tensor, dtype=torch.uint8, device="cuda"))
    DoubleTensor = property(lambda self: functools.partial(torch.tensor, dtype=torch.double, device="cuda"))
    FloatTensor = property(lambda self: functools.partial(torch.tensor, dtype=torch.float, device="cuda"))
    HalfTensor = property(lambda self: functools.partial(torch.tensor, dtype=torch.half, device="cuda"))
    IntTensor = property(lambda self: functools.partial(torch.tensor, dtype=torch.int, device="cuda"))
    LongTensor = property(lambda self: functools.partial(torch.tensor, dtype=torch.long, device="cuda"))

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1, **_: object) -> torch.Tensor:
        """A page-locked copy of ``tensor``."""
        return tensor.pin_memory()

    def export_envs(self) -> list[str]:
        """``NCCL``-prefixed variables go to every node."""
        return ["NCCL"]
