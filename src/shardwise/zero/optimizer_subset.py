"""Step a torch optimizer over a subset of its tensors (the rest keep their values and state).

Used where one optimizer step is split into parts: the optimizer-offload store steps the
device part and each host sub-group in turn (:mod:`shardwise.zero.offload`), and stages 1-2
with ``overlap_comm`` step the local shard bucket by bucket so each bucket's all-gather can
start at once (:mod:`shardwise.zero.async_gather`).

Splitting is exact only for optimizers whose update of a tensor reads that tensor, its
gradient, its own state and the group's hyperparameters, nothing else:
:func:`steps_per_tensor` names them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["restricted", "steps_per_tensor"]

# torch's element-wise optimizers: each tensor's update depends on itself, its gradient, its own
# state and its group's hyperparameters only, so stepping tensors in parts changes no bit.
_PER_TENSOR_TYPES: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.SGD,
    torch.optim.Adagrad,
    torch.optim.Adamax,
    torch.optim.Adadelta,
    torch.optim.RMSprop,
    torch.optim.NAdam,
    torch.optim.RAdam,
)


def steps_per_tensor(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` (exactly one of torch's element-wise optimizers, not a subclass) gives
    the same bits when its tensors are stepped in several parts.

    Example:
        >>> p = torch.nn.Parameter(torch.zeros(2))
        >>> steps_per_tensor(torch.optim.AdamW([p])), steps_per_tensor(torch.optim.LBFGS([p]))
        (True, False)
    """
    return type(optimizer) in _PER_TENSOR_TYPES


@contextlib.contextmanager
def restricted(optimizer: torch.optim.Optimizer, members: set[int]) -> Iterator[None]:
    """Let ``optimizer.step()`` see only the tensors whose ``id`` is in ``members`` (groups with
    none of them are hidden); the param groups are restored on exit.

    Example:
        >>> a, b = torch.nn.Parameter(torch.ones(1)), torch.nn.Parameter(torch.ones(1))
        >>> opt = torch.optim.SGD([a, b], lr=1.0)
        >>> a.grad, b.grad = torch.ones(1), torch.ones(1)
        >>> with restricted(opt, {id(a)}):
        ...     opt.step()
        >>> float(a.detach()), float(b.detach())
        (0.0, 1.0)
    """
    saved_groups = optimizer.param_groups
    saved_params = [g["params"] for g in saved_groups]
    active = []
    for group in saved_groups:
        subset = [p for p in group["params"] if id(p) in members]
        if subset:
            group["params"] = subset
            active.append(group)
    optimizer.param_groups = active
    try:
        yield
    finally:
        for group, params in zip(saved_groups, saved_params):
            group["params"] = params
        optimizer.param_groups = saved_groups
