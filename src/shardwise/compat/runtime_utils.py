"""``deepspeed.runtime.utils``: the helpers scripts call: layer partitioning (``partition_uniform``,
``partition_balanced``), ``see_memory_usage``, ``clip_grad_norm_``, ``get_weight_norm``, ``call_to_str``,
``noop_context``, ``count_used_parameters_in_backward`` (:mod:`shardwise.utils.backward_graph`), the accelerator
memory readers (``memory_status``, ``get_ma_status``, ``empty_cache``, ``torch_memory_reserved``). Its numerics
(``get_global_norm_of_tensors``, ``clip_tensors_by_global_norm``...) are :mod:`shardwise.precision.tensor_norms`,
its script helpers (``set_random_seed``...) :mod:`shardwise.runtime.script_helpers`. Functions
of DeepSpeed's own optimizers (``CheckOverflow``, bucket helpers) are not here: shardwise's ZeRO strategies check overflow themselves (:mod:`shardwise.zero.step_math`).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
from collections.abc import Iterable, Sequence

import torch

from shardwise.comm import all_reduce, get_rank, get_world_size, is_initialized, torch_api
from shardwise.comm.group_type import Group
from shardwise.compat.accelerator import get_accelerator
from shardwise.compat.ds_utils import clone_tensors_for_torch_save, move_to_device
from shardwise.utils.backward_graph import (
    check_internal_apis_for_count_used_parameters,
    count_used_parameters_in_backward,
)
from shardwise.utils.logging import logger

__all__ = [
    "call_to_str",
    "check_internal_apis_for_count_used_parameters",
    "clip_grad_norm_",
    "clone_tensors_for_torch_save",
    "count_used_parameters_in_backward",
    "empty_cache",
    "get_checkpoint_folder_size",
    "get_ma_status",
    "get_norm_with_moe_layers_fast",
    "get_weight_norm",
    "is_model_parallel_parameter",
    "memory_status",
    "move_to_device",
    "noop_context",
    "partition_balanced",
    "partition_uniform",
    "see_memory_usage",
    "torch_max_memory_reserved",
    "torch_memory_reserved",
]

noop_context = contextlib.nullcontext


def call_to_str(base: str, *args: object, **kwargs: object) -> str:
    """``base(arg, ..., key=value)`` with each value's ``repr``.

    Example:
        >>> call_to_str("hello", 1138, val=3)
        'hello(1138, val=3)'
    """
    parts = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    return f"{base}({', '.join(parts)})"


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """``num_parts + 1`` boundaries splitting ``num_items`` into parts whose sizes differ by at most one
    (the first parts get the extra items; with fewer items than parts, one item each, then empty parts).

    Example:
        >>> partition_uniform(10, 4)
        [0, 3, 6, 8, 10]
    """
    size, extra = divmod(num_items, num_parts)
    bounds = [0]
    for part in range(num_parts):
        bounds.append(bounds[-1] + size + (1 if part < extra else 0))
    return bounds


def prefix_sum_inc(weights: Iterable[float]) -> list[float]:
    """Inclusive prefix sums: element ``i`` is the sum of ``weights[0..i]``.

    Example:
        >>> prefix_sum_inc([3, 4, 5])
        [3, 7, 12]
    """
    return list(itertools.accumulate(weights))


def _fits(weights: Sequence[float], start: int, parts: int, limit: float) -> bool:
    """Whether ``weights[start:]`` splits into at most ``parts`` runs of sum <= ``limit``."""
    total, used = 0.0, 1
    for w in weights[start:]:
        if w > limit:
            return False
        if total + w > limit:
            used, total = used + 1, w
        else:
            total += w
    return used <= parts


def partition_balanced(weights: Sequence[float], num_parts: int, eps: float = 1e-3) -> list[int]:
    """``num_parts + 1`` boundaries of contiguous parts of ``weights``: the heaviest part as light as possible,
    and within that, each part as close to an even share of what is left as it can be.

    Example:
        >>> partition_balanced([1, 1, 1, 1, 1], 4)
        [0, 1, 2, 4, 5]
    """
    weights = [float(w) for w in weights]
    if num_parts <= 0:
        raise ValueError(f"partition_balanced: num_parts must be positive, got {num_parts}")
    low, high = max(weights, default=0.0), sum(weights)
    while high - low > eps * max(1.0, low):
        middle = (low + high) / 2
        low, high = (low, middle) if _fits(weights, 0, num_parts, middle) else (middle, high)
    limit = high
    bounds, start = [0], 0
    for left in range(num_parts, 1, -1):
        share = sum(weights[start:]) / left
        best_end, best_gap, total = start, share, 0.0
        for end in range(start + 1, len(weights) + 1):
            total += weights[end - 1]
            if total > limit:
                break
            if _fits(weights, end, left - 1, limit) and abs(total - share) <= best_gap:
                best_end, best_gap = end, abs(total - share)
        if not _fits(weights, best_end, left - 1, limit):  # take as much as the limit allows
            while best_end < len(weights) and not _fits(weights, best_end, left - 1, limit):
                best_end += 1
        bounds.append(best_end)
        start = best_end
    bounds.append(len(weights))
    return bounds


def see_memory_usage(message: str, force: bool = False) -> None:
    """Log ``message`` with the accelerator's memory (allocated, peak, reserved) and the host's, on rank 0;
    only when ``force`` (DeepSpeed's convention: callers leave it off outside debugging)."""
    if not force or (is_initialized() and get_rank() != 0):
        return
    acc = get_accelerator()
    gib = 1024**3
    logger.info(
        "%s | MA %.2f GB  Max_MA %.2f GB  CA %.2f GB  Max_CA %.2f GB | host: %.2f GB used of %.2f GB",
        message, acc.memory_allocated() / gib, acc.max_memory_allocated() / gib, acc.memory_reserved() / gib,
        acc.max_memory_reserved() / gib, (acc.total_memory() - acc.available_memory()) / gib,
        acc.total_memory() / gib,
    )
    acc.reset_peak_memory_stats()


def _no_mpu(name: str, mpu: object) -> None:
    if mpu is not None:
        raise NotImplementedError(
            f"deepspeed.runtime.utils.{name}(mpu=...): shardwise does not combine norms across a model-parallel "
            "group here; clip through the engine (gradient_clipping in the config), which does"
        )


def clip_grad_norm_(parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float, norm_type: float = 2,
                    mpu: object = None) -> float:
    """Scale the gradients of ``parameters`` so their total norm is at most ``max_norm``; returns the norm
    before clipping (torch's ``clip_grad_norm_`` rule: coefficient ``max_norm / (norm + 1e-6)``)."""
    _no_mpu("clip_grad_norm_", mpu)
    return float(torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type))


def get_weight_norm(parameters: Iterable[torch.Tensor] | torch.Tensor, norm_type: float = 2, mpu: object = None) -> float:
    """The total ``norm_type`` norm of the tensors themselves (not their gradients); -1 when it is inf or NaN."""
    _no_mpu("get_weight_norm", mpu)
    tensors = [parameters] if torch.is_tensor(parameters) else list(parameters)
    norms = torch.stack([torch.linalg.vector_norm(t.detach().float(), norm_type) for t in tensors])
    total = float(torch.linalg.vector_norm(norms, norm_type)) if tensors else 0.0
    return -1.0 if math.isinf(total) or math.isnan(total) else total


def is_model_parallel_parameter(p: torch.Tensor) -> bool:
    """Whether ``p`` is a tensor-parallel slice (Megatron's ``model_parallel`` or DeepSpeed's
    ``tensor_model_parallel`` marker, which shardwise's tensor-parallel layers set)."""
    return bool(getattr(p, "model_parallel", False) or getattr(p, "tensor_model_parallel", False))


def torch_memory_reserved(device_index: int | None = None) -> int:
    """Bytes the accelerator's caching allocator holds (on CPU: allocated bytes, as DeepSpeed's CPU accelerator)."""
    return int(get_accelerator().memory_reserved(device_index))


def torch_max_memory_reserved(device_index: int | None = None) -> int:
    """The peak of :func:`torch_memory_reserved` since the last reset."""
    return int(get_accelerator().max_memory_reserved(device_index))


def get_ma_status() -> int:
    """Bytes allocated on the accelerator, on rank 0 (0 on the other ranks)."""
    if is_initialized() and get_rank() != 0:
        return 0
    return int(get_accelerator().memory_allocated())


def empty_cache() -> None:
    """Release the accelerator's cached memory and reset its peak statistics."""
    acc = get_accelerator()
    acc.empty_cache()
    acc.reset_peak_memory_stats()


_LAST_MEMORY = {"allocated": 0, "cached": 0}


def memory_status(msg: str, print_rank: int = -1, reset_max: bool = False) -> None:
    """Log (every rank, or only ``print_rank``) the accelerator's allocated and cached memory, with the change
    since the previous call and the peaks; ``reset_max`` resets the peaks first."""
    rank = get_rank() if is_initialized() else 0
    if print_rank != -1 and rank != print_rank:
        return
    acc = get_accelerator()
    acc.synchronize()
    if reset_max:
        acc.reset_peak_memory_stats()
    allocated, cached = acc.memory_allocated(), acc.memory_reserved()
    delta_allocated, delta_cached = allocated - _LAST_MEMORY["allocated"], cached - _LAST_MEMORY["cached"]
    _LAST_MEMORY.update(allocated=allocated, cached=cached)
    gib = 1024**3
    logger.info(
        "RANK=%d MEMSTATS %s device=%s current alloc=%.4fGB (delta=%.4fGB max=%.4fGB) "
        "current cache=%.4fGB (delta=%.4fGB max=%.4fGB)",
        rank, msg, acc.current_device_name(), allocated / gib, delta_allocated / gib,
        acc.max_memory_allocated() / gib, cached / gib, delta_cached / gib, acc.max_memory_reserved() / gib,
        extra={"all_ranks": True},
    )


def get_norm_with_moe_layers_fast(all_groups_norm: float, group: Group) -> float:
    """The mean of ``all_groups_norm`` over the ranks of ``group`` (expert gradients are not reduced across
    ranks, so each rank's norm differs; this gives every rank the same one). Collective over ``group``."""
    norm = torch.tensor(float(all_groups_norm) / get_world_size(group), dtype=torch.float)
    all_reduce(norm, group=group)
    return float(norm.item())


def get_checkpoint_folder_size(save_dir: str, tag: str, local_rank: int | None = None) -> int:
    """Bytes of the files under ``save_dir/tag``, counted by the rank whose ``local_rank`` is 0 and summed
    onto global rank 0 (the other ranks' result is 0 unless they are a node's first rank). Collective."""
    size = 0
    if local_rank == 0:
        for path, _, files in os.walk(os.path.join(save_dir, tag)):
            size += sum(os.path.getsize(os.path.join(path, f)) for f in files)
    total = torch.tensor(size, dtype=torch.int64, device=get_accelerator().current_device_name())
    torch_api.reduce(total, 0)
    return int(total)
