"""``deepspeed.utils``' full-parameter accessors under their ``tensor_fragment`` names, over shardwise's
:mod:`shardwise.zero.param_access` (the ``safe_get_full_*``/``safe_set_full_*`` family).

DeepSpeed binds ``get_full_hp_param`` and friends to each parameter as methods (``self`` is the
parameter); called as functions they take the parameter first. Each is collective where its
``safe_*`` counterpart is: every rank calls it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from shardwise.zero.param_access import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_grad,
    safe_set_full_optimizer_state,
)

__all__ = [
    "get_full_hp_grad",
    "get_full_hp_param",
    "safe_update_full_grad_vectorized",
    "set_full_hp_grad",
    "set_full_hp_param",
]


def get_full_hp_param(param: torch.Tensor, optim_state_key: str | None = None) -> torch.Tensor | None:
    """The full fp32 value of ``param`` or, with ``optim_state_key``, of that optimizer state."""
    if optim_state_key is None:
        return safe_get_full_fp32_param(param)
    return safe_get_full_optimizer_state(param, optim_state_key)


def set_full_hp_param(param: torch.Tensor, value: torch.Tensor, optim_state_key: str | None = None) -> None:
    """Write the full fp32 value of ``param`` or, with ``optim_state_key``, of that optimizer state."""
    if optim_state_key is None:
        safe_set_full_fp32_param(param, value)
    else:
        safe_set_full_optimizer_state(param, value, optim_state_key)


def get_full_hp_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The full reduced fp32 gradient of ``param`` (:func:`shardwise.zero.param_access.safe_get_full_grad`)."""
    return safe_get_full_grad(param)


def set_full_hp_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Replace the reduced gradient of ``param`` for the coming step."""
    safe_set_full_grad(param, value)


def safe_update_full_grad_vectorized(
    param_list: Iterable[torch.nn.Parameter],
    update_func: Callable[[torch.Tensor, torch.nn.Parameter], torch.Tensor],
) -> None:
    """Replace each parameter's gradient with ``update_func(gradient, param)``: in place in ``param.grad``
    where the parameter holds its gradient, else the engine's reduced gradient (read and written whole,
    collective) for parameters that require one."""
    for p in param_list:
        if p.grad is not None:
            p.grad.copy_(update_func(p.grad, p))
        elif p.requires_grad:
            current = safe_get_full_grad(p)
            if current is not None:
                safe_set_full_grad(p, update_func(current, p))
