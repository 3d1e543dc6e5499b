"""Step a torch optimizer over a subset of its tensors (the rest keep their values and state).

Used where one optimizer step is split into parts: the optimizer-offload store steps the
device part and each host sub-group in turn (:mod:`shardwise.zero.offload`), stage 3 without
a store steps its local shard one ``sub_group_size`` sub-group at a time
(:func:`step_in_sub_groups`, :mod:`shardwise.zero.stage3`), and stages 1-2 with
``overlap_comm`` step the local shard bucket by bucket so each bucket's all-gather can start
at once (:mod:`shardwise.zero.async_gather`).

Splitting is exact only for optimizers whose update of a tensor reads that tensor, its
gradient, its own state and the group's hyperparameters, nothing else:
:func:`steps_per_tensor` names them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from shardwise.optim.fused_adam import ADAM_CLASSES

__all__ = ["restricted", "split_sub_groups", "step_in_sub_groups", "steps_per_tensor"]

# torch's element-wise optimizers: each tensor's update depends on itself, its gradient, its own
# state and its group's hyperparameters only, so stepping tensors in parts changes no bit.
_PER_TENSOR_TYPES: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.Adam,
    torch.optim.AdamW,
    *ADAM_CLASSES,  # DeepSpeed's FusedAdam / DeepSpeedCPUAdam: torch's Adam update
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


def split_sub_groups(numels: Sequence[int], sub_group_size: int) -> list[list[int]]:
    """Consecutive tensor indices grouped so each group holds at most ``sub_group_size``
    elements (a larger tensor is a group of its own).

    Example:
        >>> split_sub_groups([3, 3, 5, 1], 6)
        [[0, 1], [2, 3]]
    """
    groups: list[list[int]] = []
    current: list[int] = []
    total = 0
    for index, numel in enumerate(numels):
        if current and total + numel > sub_group_size:
            groups.append(current)
            current, total = [], 0
        current.append(index)
        total += numel
    if current:
        groups.append(current)
    return groups


def step_in_sub_groups(optimizer: torch.optim.Optimizer, sub_group_size: int) -> int:
    """``optimizer.step()`` once per sub-group of at most ``sub_group_size`` elements (its
    tensors in param-group order, split by :func:`split_sub_groups`), each step seeing only that
    sub-group; one plain step when everything fits in one. The caller makes sure the optimizer
    :func:`steps_per_tensor`, which makes the result bitwise that of one step.

    Returns:
        the number of ``step()`` calls made.

    Example:
        >>> a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
        >>> opt = torch.optim.SGD([a, b], lr=1.0)
        >>> a.grad, b.grad = torch.ones(3), torch.ones(2)
        >>> step_in_sub_groups(opt, 3), float(a.detach().sum()), float(b.detach().sum())
        (2, 0.0, 0.0)
    """
    tensors = [t for group in optimizer.param_groups for t in group["params"]]
    groups = split_sub_groups([t.numel() for t in tensors], sub_group_size)
    if len(groups) <= 1:
        optimizer.step()
        return 1
    for indices in groups:
        with restricted(optimizer, {id(tensors[i]) for i in indices}):
            optimizer.step()
    return len(groups)
