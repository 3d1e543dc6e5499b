"""What the hand-written optimizers (Adam without bias correction, Lamb, Lion) share: run
the closure, and collect a param group's tensors for ``torch._foreach_*`` kernels.

Written here rather than taken from ``torch.optim``: torch's own helpers for this are
private (``_default_to_fused_or_foreach``, ``_group_tensors_by_device_and_dtype``) and
create state in each optimizer's ``_init_group``, so there is nothing public to reuse.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor


def run_closure(closure: Callable[[], float] | None) -> float | None:
    """``closure()`` with gradients enabled (optimizer steps run under ``no_grad``), or None."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


@dataclass
class GroupTensors:
    """A param group's parameters that have a gradient, in order, with their state.

    ``moments[key]`` lists each parameter's state buffer ``key``; ``steps`` the step counters.
    """

    params: list[Tensor] = field(default_factory=list)
    grads: list[Tensor] = field(default_factory=list)
    moments: dict[str, list[Tensor]] = field(default_factory=dict)
    steps: list[Tensor] = field(default_factory=list)


def collect_group(
    state: Any, group: dict[str, Any], moments: tuple[str, ...], name: str
) -> dict[int, GroupTensors]:
    """The group's tensors, created as zeros on first use, bucketed by step count.

    Args:
        state: the optimizer's ``state`` mapping.
        group: one param group.
        moments: state buffers per parameter (e.g. ``("exp_avg", "exp_avg_sq")``).
        name: the optimizer's name, for the sparse-gradient error.

    Parameters share one step count unless some got no gradient on an earlier step;
    optimizers with bias correction then update each bucket with its own count.

    Example:
        >>> w = torch.nn.Parameter(torch.ones(2)); w.grad = torch.ones(2)
        >>> buckets = collect_group({}, {"params": [w]}, ("exp_avg",), "Demo")
        >>> list(buckets), buckets[0].moments["exp_avg"][0].tolist()
        ([0], [0.0, 0.0])
    """
    buckets: dict[int, GroupTensors] = {}
    for p in group["params"]:
        if p.grad is None:
            continue
        if p.grad.is_sparse:
            raise ValueError(f"{name} does not support sparse gradients.")
        per_param = state.setdefault(p, {})
        if not per_param:
            # the step count keeps checkpoints shaped like torch's own optimizers
            per_param["step"] = torch.tensor(0.0)
            for key in moments:
                per_param[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
        count = int(per_param["step"].item())  # a CPU scalar: no device sync
        tensors = buckets.setdefault(count, GroupTensors(moments={key: [] for key in moments}))
        tensors.params.append(p)
        tensors.grads.append(p.grad)
        for key in moments:
            tensors.moments[key].append(per_param[key])
        tensors.steps.append(per_param["step"])
    return buckets
