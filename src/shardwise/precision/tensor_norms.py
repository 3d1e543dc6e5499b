"""Norms of lists of tensors and the clipping and checks built on them: DeepSpeed's
``deepspeed.runtime.utils`` numerics (``get_global_norm_of_tensors``, ``clip_tensors_by_global_norm``,
``get_global_norm``, ``combine_grad_norm_groups``, ``get_flattened_grad_norm``, ``get_grad_zeros``,
``has_inf_or_nan``, ``is_invalid_grad_norm``, ``mask_nan_or_inf_with_val_inplace``) and the small tensor
helpers beside them (``align_dense_tensors``, ``get_only_unique_item``, ``get_tensor_bytes``).

Norms are taken in float32 and combined as DeepSpeed does: the ``p``-norm of the per-tensor norms
(``inf``: their maximum). An invalid norm (inf or NaN) is reported as DeepSpeed reports it: ``-1`` from
the per-tensor helpers, ``inf`` from the combiners. Model-parallel reductions (``mpu=``) are not
done here: the engine's ``gradient_clipping`` reduces over the right groups; passing an ``mpu`` raises.

Example:
    >>> import torch
    >>> float(get_global_norm_of_tensors([torch.tensor([3.0]), torch.tensor([4.0])]))
    5.0
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch

__all__ = [
    "align_dense_tensors",
    "clip_tensors_by_global_norm",
    "combine_grad_norm_groups",
    "get_flattened_grad_norm",
    "get_global_norm",
    "get_global_norm_of_tensors",
    "get_grad_zeros",
    "get_only_unique_item",
    "get_tensor_bytes",
    "has_inf_or_nan",
    "is_invalid_grad_norm",
    "mask_nan_or_inf_with_val_inplace",
]


def _no_mpu(name: str, mpu: object) -> None:
    if mpu is not None:
        raise NotImplementedError(
            f"deepspeed.runtime.utils.{name}(mpu=...): shardwise does not reduce norms over a model-parallel "
            "group here; clip through the engine (gradient_clipping in the config), which does"
        )


def has_inf_or_nan(x: torch.Tensor) -> torch.Tensor:
    """Whether ``x`` holds a NaN or an infinity, as a boolean scalar tensor on ``x``'s device (no host sync;
    an empty tensor: False; a sparse one: its stored values)."""
    if x.is_sparse:
        x = x._values()
    if x.numel() == 0:
        return torch.tensor(False, device=x.device)
    return ~(torch.isfinite(x.amax()) & torch.isfinite(x.amin()))


def is_invalid_grad_norm(norm: float | torch.Tensor) -> bool:
    """Whether ``norm`` is not a usable norm: inf, NaN, or negative (the ``-1`` invalid marker)."""
    if torch.is_tensor(norm):
        return bool((~torch.isfinite(norm) | (norm < 0)).any())
    value = float(norm)
    return not math.isfinite(value) or value < 0


def get_global_norm(norm_list: Sequence[float | torch.Tensor]) -> float:
    """The 2-norm of a list of norms; ``inf`` when one of them is invalid.

    Example:
        >>> get_global_norm([3.0, 4.0]), get_global_norm([3.0, -1.0])
        (5.0, inf)
    """
    if any(is_invalid_grad_norm(n) for n in norm_list):
        return float("inf")
    return math.sqrt(sum(float(n) ** 2 for n in norm_list))


def combine_grad_norm_groups(norm_groups: Iterable[float | torch.Tensor], norm_type: float = 2) -> torch.Tensor:
    """The ``norm_type`` norm of per-group norms, as a tensor; ``inf`` when one group's norm is invalid
    (so a ``-1`` marker is never squared into a healthy-looking 1)."""
    norms = list(norm_groups)
    device = next((n.device for n in norms if torch.is_tensor(n)), None)
    stacked = torch.stack(
        [n.float() if torch.is_tensor(n) else torch.tensor(float(n), device=device) for n in norms]
    )
    combined = torch.linalg.vector_norm(stacked, ord=norm_type)
    invalid = (~torch.isfinite(stacked) | (stacked < 0)).any()
    return torch.where(invalid, torch.full_like(combined, float("inf")), combined)


def mask_nan_or_inf_with_val_inplace(input: torch.Tensor, device: Any = None, val: float = -1.0) -> None:
    """Set every NaN or infinite element of ``input`` to ``val`` in place (``device``: where ``val`` is made)."""
    input.masked_fill_(~torch.isfinite(input), torch.tensor(val, device=device, dtype=torch.float))


def get_global_norm_of_tensors(
    input_tensors: Sequence[torch.Tensor], norm_type: float = 2, mpu: object = None, moe_ep_group: object = None
) -> torch.Tensor:
    """The ``norm_type`` norm of ``input_tensors`` viewed as one vector, as a float32 scalar tensor on the first
    tensor's device; ``-1`` when it is inf or NaN."""
    _no_mpu("get_global_norm_of_tensors", mpu)
    if moe_ep_group is not None:
        raise NotImplementedError(
            "deepspeed.runtime.utils.get_global_norm_of_tensors(moe_ep_group=...): shardwise reduces expert "
            "gradient norms in its ZeRO strategies; clip through the engine (gradient_clipping)"
        )
    tensors = list(input_tensors)
    if not all(torch.is_tensor(t) for t in tensors):
        raise TypeError("get_global_norm_of_tensors: expected a list of tensors only")
    p = float(norm_type)
    if p == math.inf:
        total = torch.stack([t.detach().abs().max().float() for t in tensors]).max()
    else:
        total = torch.stack([t.detach().float().norm(p) for t in tensors]).pow(p).sum().pow(1.0 / p)
    total = total.to(tensors[0].device)
    mask_nan_or_inf_with_val_inplace(total, device=total.device)
    return total


def clip_tensors_by_global_norm(
    input_tensors: Sequence[torch.Tensor], max_norm: float = 1.0, global_norm: float | torch.Tensor | None = None,
    mpu: object = None, eps: float = 1e-6,
) -> float | torch.Tensor:
    """Scale ``input_tensors`` in place by ``max_norm / (global_norm + eps)`` when that is below 1; returns the
    global norm (computed with :func:`get_global_norm_of_tensors` unless given)."""
    _no_mpu("clip_tensors_by_global_norm", mpu)
    if global_norm is None:
        global_norm = get_global_norm_of_tensors(input_tensors)
    coefficient = max_norm / (global_norm + eps)
    if coefficient < 1:
        for t in input_tensors:
            t.detach().mul_(coefficient)
    return global_norm


def _with_grads(parameters: Iterable[torch.Tensor] | torch.Tensor) -> list[torch.Tensor]:
    params = [parameters] if torch.is_tensor(parameters) else list(parameters)
    return [p for p in params if p.grad is not None]


def get_flattened_grad_norm(
    parameters: Iterable[torch.Tensor] | torch.Tensor, norm_type: float = 2, mpu: object = None,
    grad_norm_mask: Sequence[torch.Tensor] | None = None,
) -> float:
    """The ``norm_type`` norm of the parameters' gradients as one vector; ``-1`` when inf or NaN.

    ``grad_norm_mask[i]``: rows ``[start, end)`` of parameter ``i``'s gradient (an ``[n, 2]`` tensor of
    element ranges along dimension 0) left out of the norm (elements another rank already counts).
    """
    _no_mpu("get_flattened_grad_norm", mpu)
    grads = [p.grad.detach() for p in _with_grads(parameters)]  # type: ignore[union-attr]
    p = float(norm_type)
    if p == math.inf:
        total = max((float(g.abs().max()) for g in grads), default=0.0)
    else:
        acc = 0.0
        for i, g in enumerate(grads):
            if grad_norm_mask is not None and len(grad_norm_mask[i]) > 0:
                keep = torch.ones(g.shape[0], dtype=torch.bool, device=g.device)
                for start, end in grad_norm_mask[i].tolist():
                    keep[start:end] = False
                g = g[keep]
            acc += float(g.float().norm(p)) ** p
        total = acc ** (1.0 / p)
    return -1.0 if math.isinf(total) or math.isnan(total) else total


def get_grad_zeros(parameters: Iterable[torch.Tensor] | torch.Tensor, mpu: object = None) -> float:
    """How many gradient elements are exactly zero, over the parameters that have a gradient (a float, as
    DeepSpeed returns it); parameters marked ``ds_pipe_replicated`` are counted once, by their owner."""
    _no_mpu("get_grad_zeros", mpu)
    total = 0
    for p in _with_grads(parameters):
        if getattr(p, "ds_pipe_replicated", False):
            continue
        grad = p.grad
        assert grad is not None  # _with_grads keeps only these
        total += grad.numel() - int(torch.count_nonzero(grad))
    return float(total)


def align_dense_tensors(tensor_list: list[torch.Tensor], alignment: int) -> list[torch.Tensor]:
    """``tensor_list``, plus a zero tensor (the first's dtype and device) when needed so the total element
    count is a multiple of ``alignment``.

    Example:
        >>> [t.numel() for t in align_dense_tensors([torch.ones(3), torch.ones(2)], 4)]
        [3, 2, 3]
    """
    remaining = sum(t.numel() for t in tensor_list) % alignment
    if not remaining:
        return tensor_list
    pad = torch.zeros(alignment - remaining, dtype=tensor_list[0].dtype, device=tensor_list[0].device)
    return [*tensor_list, pad]


def get_only_unique_item(items: Iterable[Any]) -> Any:
    """The one distinct value of ``items``; raises ``RuntimeError`` when there are none or several.

    Example:
        >>> get_only_unique_item([2, 2, 2])
        2
    """
    distinct = set(items)
    if len(distinct) != 1:
        raise RuntimeError(f"expected there to be only one unique element in {items}")
    return next(iter(distinct))


def get_tensor_bytes(item: Any) -> int:
    """Bytes held by the tensors in ``item`` (a tensor, or nested lists, tuples and dicts of them).

    Example:
        >>> get_tensor_bytes({"a": torch.ones(2), "b": [torch.ones(3, dtype=torch.float16)]})
        14
    """
    if torch.is_tensor(item):
        return item.numel() * item.element_size()
    if isinstance(item, dict):
        return sum(get_tensor_bytes(v) for v in item.values())
    if isinstance(item, list | tuple):
        return sum(get_tensor_bytes(v) for v in item)
    return 0
