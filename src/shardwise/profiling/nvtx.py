"""NVTX ranges around functions, for Nsight timelines: :func:`instrument_w_nvtx` (DeepSpeed's
``deepspeed.utils.instrument_w_nvtx``).

A decorated function pushes a range named by its qualified name on entry and pops it on exit (also
when it raises) while CUDA is available and ``torch.compile`` is not tracing (a range would break the
graph); elsewhere it runs unchanged.

Example:
    >>> @instrument_w_nvtx
    ... def step(x): return x + 1
    >>> step(1), step.__name__
    (2, 'step')
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["instrument_w_nvtx"]

F = TypeVar("F", bound=Callable[..., Any])


def _ranges_on() -> bool:
    return torch.cuda.is_available() and not torch.compiler.is_compiling()


def instrument_w_nvtx(func: F) -> F:
    """``func`` inside an NVTX range named ``func.__qualname__`` (see the module docstring)."""

    @functools.wraps(func)
    def ranged(*args: Any, **kwargs: Any) -> Any:
        if not _ranges_on():
            return func(*args, **kwargs)
        torch.cuda.nvtx.range_push(func.__qualname__)
        try:
            return func(*args, **kwargs)
        finally:
            torch.cuda.nvtx.range_pop()

    return ranged  # type: ignore[return-value]
