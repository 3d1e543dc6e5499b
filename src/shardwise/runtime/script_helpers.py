"""Small helpers DeepSpeed's ``deepspeed.runtime.utils`` gives training scripts: seeding every generator
(``set_random_seed``), making a file's directory, parameter filters for optimizer groups
(``filter_empty_parameters``, ``is_optimized_parameter``), ``DummyOptim``, nested copies to a device
(``copy_to_device``), comparing nested structures of tensors, ``noop_decorator``, and moving a torch Adam's
moments off the device and back (``offload_adam_states``/``reload_adam_states``).

Example:
    >>> set_random_seed(7); import torch; a = torch.rand(1)
    >>> set_random_seed(7); bool(torch.equal(a, torch.rand(1)))
    True
"""

from __future__ import annotations

import os
import random
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

__all__ = [
    "DummyOptim",
    "compare_tensors_in_structures",
    "copy_to_device",
    "ensure_directory_exists",
    "filter_empty_parameters",
    "is_optimized_parameter",
    "is_transformers_cache",
    "maybe_loss_for_backward",
    "noop_decorator",
    "offload_adam_states",
    "reload_adam_states",
    "set_random_seed",
]

F = TypeVar("F")


def set_random_seed(seed: int) -> None:
    """Seed Python's ``random``, NumPy's global generator (``seed mod 2**32``) and torch (``seed mod 2**63``)."""
    import numpy

    random.seed(seed)
    numpy.random.seed(seed % 2**32)
    torch.manual_seed(seed % 2**63)


def ensure_directory_exists(filename: str) -> None:
    """Create the directory that will hold ``filename`` (and its parents) if it does not exist."""
    os.makedirs(os.path.dirname(filename), exist_ok=True)


def noop_decorator(func: F) -> F:
    """``func`` itself (a decorator that does nothing, for optional instrumentation)."""
    return func


class DummyOptim:
    """An optimizer stand-in with one parameter group holding ``params`` (DeepSpeed uses it to run ZeRO-3
    without an optimizer); it has no ``step``."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.param_groups: list[dict[str, Any]] = [{"params": params}]


def filter_empty_parameters(params: Any) -> Any:
    """``params`` (a list of parameters, or of parameter-group dicts) without zero-element parameters;
    a group left with none is dropped. Anything else (an empty list, a generator) is returned as is."""
    if not isinstance(params, list | tuple) or not params:
        return params
    if not isinstance(params[0], dict):
        return [p for p in params if p.numel() > 0]
    groups = []
    for group in params:
        kept = [p for p in group.get("params", []) if p.numel() > 0]
        if kept:
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": kept})
    return groups


def is_optimized_parameter(param: torch.Tensor) -> bool:
    """Whether an optimizer should own ``param``: it requires a gradient and has at least one element
    (``ds_numel``, a partitioned parameter's full size, where present)."""
    numel = getattr(param, "ds_numel", None)
    return bool(param.requires_grad) and (param.numel() if numel is None else numel) > 0


def copy_to_device(item: Any, device: torch.device | str, criterion_func: Callable[[Any], bool]) -> Any:
    """A copy of ``item`` whose entries ``criterion_func`` picks are moved to ``device`` (nested lists,
    tuples and dicts rebuilt; other values kept)."""
    if criterion_func(item):
        return item.to(device)
    if isinstance(item, list):
        return [copy_to_device(v, device, criterion_func) for v in item]
    if isinstance(item, tuple):
        return tuple(copy_to_device(v, device, criterion_func) for v in item)
    if isinstance(item, dict):
        return {k: copy_to_device(v, device, criterion_func) for k, v in item.items()}
    return item


def is_transformers_cache(obj: object) -> bool:
    """Whether ``obj`` is a ``transformers`` KV cache. Only a loaded ``transformers.cache_utils`` can have
    made one, so this never imports transformers."""
    cache_utils = sys.modules.get("transformers.cache_utils")
    cache = getattr(cache_utils, "Cache", None)
    return cache is not None and isinstance(obj, cache)


def _equal_values(a: object, b: object) -> bool:
    if is_transformers_cache(a) and is_transformers_cache(b):
        return type(a) is type(b)  # caches are compared by kind only
    if torch.is_tensor(a) and torch.is_tensor(b):
        return bool(torch.equal(a, b.to(a.device)))
    return bool(a == b)


def compare_tensors_in_structures(inputs1: list[Any] | dict[Any, Any], inputs2: list[Any] | dict[Any, Any]) -> bool:
    """Whether two lists (or two dicts) hold equal values position by position (key by key), tensors
    compared with ``torch.equal``; different types, lengths or keys are unequal."""
    if type(inputs1) is not type(inputs2):
        return False
    if isinstance(inputs1, list) and isinstance(inputs2, list):
        return len(inputs1) == len(inputs2) and all(_equal_values(a, b) for a, b in zip(inputs1, inputs2))
    if isinstance(inputs1, dict) and isinstance(inputs2, dict):
        return inputs1.keys() == inputs2.keys() and all(_equal_values(inputs1[k], inputs2[k]) for k in inputs1)
    return False


def maybe_loss_for_backward(value: object) -> bool:
    """Whether ``value`` looks like a loss to call ``backward`` on: a one-element tensor with a ``grad_fn``."""
    return torch.is_tensor(value) and value.numel() == 1 and value.grad_fn is not None


_ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")


def _offload_key(key: str) -> str:
    return f"{key}_offload_buffer"


def offload_adam_states(optimizer: torch.optim.Optimizer, device: torch.device | str, pin_memory: bool = False,
                        non_blocking: bool = False) -> None:
    """Move every parameter's ``exp_avg``/``exp_avg_sq`` (a torch Adam's state) into a buffer on ``device``,
    kept in the state as ``<key>_offload_buffer`` and reused by later calls; the state's tensors then point at it.
    ``pin_memory`` page-locks a new buffer where CUDA exists (it only speeds copies to and from a GPU)."""
    for state in optimizer.state.values():
        for key in _ADAM_MOMENTS:
            if key not in state:
                continue
            buffer_key = _offload_key(key)
            if buffer_key not in state:
                buffer = torch.empty_like(state[key], device=device)
                state[buffer_key] = buffer.pin_memory() if pin_memory and torch.cuda.is_available() else buffer
            state[buffer_key].copy_(state[key], non_blocking=non_blocking)
            state[key].data = state[buffer_key]


def reload_adam_states(optimizer: torch.optim.Optimizer, device: torch.device | str, non_blocking: bool = False) -> None:
    """Bring the moments :func:`offload_adam_states` moved back to ``device`` (the offload buffers stay)."""
    for state in optimizer.state.values():
        for key in _ADAM_MOMENTS:
            if key in state:
                state[key].data = state[_offload_key(key)].to(device, non_blocking=non_blocking)
