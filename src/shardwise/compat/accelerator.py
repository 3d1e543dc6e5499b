"""``deepspeed.accelerator``: ``get_accelerator()``, the device the ranks train on, with DeepSpeed's interface.

CUDA (:mod:`~shardwise.compat.cuda_accelerator`, over ``torch.cuda``) when torch sees a GPU, else the CPU
(:mod:`~shardwise.compat.cpu_accelerator`, DeepSpeed's CPU semantics); ``DS_ACCELERATOR=cpu|cuda`` overrides,
as in DeepSpeed. One instance per process.
"""

from __future__ import annotations

import os

import torch

from shardwise.compat.cpu_accelerator import SUPPORTED_ACCELERATORS, CpuAccelerator
from shardwise.compat.cuda_accelerator import CudaAccelerator

__all__ = ["CpuAccelerator", "CudaAccelerator", "get_accelerator", "is_current_accelerator_supported", "set_accelerator"]

_ACCELERATOR: CpuAccelerator | None = None


def is_current_accelerator_supported() -> bool:
    """Whether the accelerator in use is one shardwise runs on (always: CPU or CUDA)."""
    return get_accelerator()._name in SUPPORTED_ACCELERATORS


def get_accelerator() -> CpuAccelerator:
    """The process's accelerator (one instance, as in DeepSpeed): ``DS_ACCELERATOR``, else CUDA when a GPU is
    visible, else CPU. An unsupported ``DS_ACCELERATOR`` raises naming it and the supported ones."""
    global _ACCELERATOR
    if _ACCELERATOR is None:
        wanted = os.environ.get("DS_ACCELERATOR") or ("cuda" if torch.cuda.is_available() else "cpu")
        if wanted not in SUPPORTED_ACCELERATORS:
            raise ValueError(
                f"DS_ACCELERATOR={wanted!r}: shardwise runs on {' or '.join(SUPPORTED_ACCELERATORS)}; "
                "unset it or choose one of those"
            )
        if wanted == "cuda" and not torch.cuda.is_available():
            raise ValueError("DS_ACCELERATOR='cuda' but torch sees no CUDA device; unset it or use 'cpu'")
        _ACCELERATOR = CudaAccelerator() if wanted == "cuda" else CpuAccelerator()
    return _ACCELERATOR


def set_accelerator(accelerator: CpuAccelerator) -> None:
    """Use ``accelerator`` from now on (DeepSpeed's ``set_accelerator``); it must be a shardwise accelerator."""
    global _ACCELERATOR
    if not isinstance(accelerator, CpuAccelerator):
        raise TypeError(
            f"set_accelerator({type(accelerator).__name__}): shardwise takes its CpuAccelerator or CudaAccelerator "
            "(DeepSpeed's other accelerator classes have no meaning here)"
        )
    _ACCELERATOR = accelerator
