"""``deepspeed.accelerator.get_accelerator()``: the device the ranks train on, with DeepSpeed's method names.

Only what clients call is here (``device_name``, ``current_device_name``, ``current_device``,
``device_count``, ``is_available``, ``communication_backend_name``, ``synchronize``,
``empty_cache``, ``manual_seed``, ``is_bf16_supported``, ``is_fp16_supported``); anything else raises
an ``AttributeError`` naming it.
"""

from __future__ import annotations

import os
from typing import Any

import torch


class Accelerator:
    """CUDA when torch sees a GPU, else CPU (``_name`` is ``"cuda"`` or ``"cpu"``, as in DeepSpeed)."""

    def __init__(self) -> None:
        self._name = "cuda" if torch.cuda.is_available() else "cpu"
        self._communication_backend_name = "nccl" if self._name == "cuda" else "gloo"

    def device_name(self, device_index: int | str | None = None) -> str:
        """``"cuda"``/``"cuda:N"`` or ``"cpu"`` (a CPU has no index)."""
        if device_index is None or self._name == "cpu":
            return self._name
        return f"{self._name}:{device_index}"

    def current_device(self) -> int:
        """The current CUDA device index, or the local rank on CPU."""
        if self._name == "cuda":
            return torch.cuda.current_device()
        return int(os.environ.get("LOCAL_RANK", 0))

    def current_device_name(self) -> str:
        """``"cuda:N"`` for the current device, ``"cpu"`` on CPU."""
        return self.device_name(self.current_device() if self._name == "cuda" else None)

    def device_count(self) -> int:
        """GPUs visible, or 1 on CPU."""
        return torch.cuda.device_count() if self._name == "cuda" else 1

    def is_available(self) -> bool:
        """Always true: the CPU is always there."""
        return True

    def communication_backend_name(self) -> str:
        """``"nccl"`` on CUDA, ``"gloo"`` on CPU."""
        return self._communication_backend_name

    def synchronize(self, device_index: Any = None) -> None:
        """Wait for the device's queued work (no-op on CPU)."""
        if self._name == "cuda":
            torch.cuda.synchronize(device_index)

    def empty_cache(self) -> None:
        """Release cached device memory (no-op on CPU)."""
        if self._name == "cuda":
            torch.cuda.empty_cache()

    def manual_seed(self, seed: int) -> None:
        """Seed the device's generator."""
        torch.manual_seed(seed) if self._name == "cpu" else torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        """Seed every device's generator."""
        torch.manual_seed(seed) if self._name == "cpu" else torch.cuda.manual_seed_all(seed)

    def is_bf16_supported(self) -> bool:
        """bf16 works on CPU; on CUDA as torch reports."""
        return True if self._name == "cpu" else torch.cuda.is_bf16_supported()

    def is_fp16_supported(self) -> bool:
        """fp16 works (slowly) on CPU and on every CUDA device."""
        return True


_ACCELERATOR: Accelerator | None = None


def get_accelerator() -> Accelerator:
    """The process's :class:`Accelerator` (one instance, as in DeepSpeed)."""
    global _ACCELERATOR
    if _ACCELERATOR is None:
        _ACCELERATOR = Accelerator()
    return _ACCELERATOR
