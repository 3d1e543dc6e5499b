"""Questions about the backward pass that is running now, asked from inside one of its hooks.

torch answers them through its autograd-graph introspection (``torch.autograd.graph``'s gradient
accumulator lookup and the engine's "will this node run" query); shardwise wraps them because DeepSpeed
scripts call ``deepspeed.runtime.utils.count_used_parameters_in_backward`` from their hooks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["check_internal_apis_for_count_used_parameters", "count_used_parameters_in_backward"]

_INTROSPECTION = (("torch.autograd.graph", "_get_grad_fn_or_grad_acc"), ("torch._C", "_will_engine_execute_node"),
                  ("torch._C", "_current_graph_task_id"))


def _introspection() -> list[Callable[..., Any] | None]:
    owners = {"torch.autograd.graph": torch.autograd.graph, "torch._C": torch._C}
    return [getattr(owners[owner], name, None) for owner, name in _INTROSPECTION]


def check_internal_apis_for_count_used_parameters() -> bool:
    """Whether this torch has the autograd-graph introspection :func:`count_used_parameters_in_backward` needs."""
    return all(api is not None for api in _introspection())


def count_used_parameters_in_backward(parameters: Iterable[torch.Tensor]) -> int:
    """How many of ``parameters`` the backward pass running now reaches: those whose gradient
    accumulator the autograd engine will execute. Call it from a backward hook.

    Parameters that do not require a gradient, or that this backward does not touch (unused in the
    loss, or detached), are not counted; parameters sharing one accumulator count once.

    Raises:
        RuntimeError: no backward pass is running, or this torch lacks the introspection it needs.

    Example:
        >>> import torch
        >>> used, unused = torch.nn.Parameter(torch.ones(1)), torch.nn.Parameter(torch.ones(1))
        >>> seen = []
        >>> _ = used.register_hook(lambda g: seen.append(count_used_parameters_in_backward([used, unused])))
        >>> (used * 2).sum().backward()
        >>> seen
        [1]
    """
    lookup, will_run, task_id = _introspection()
    if lookup is None or will_run is None or task_id is None:
        raise RuntimeError(f"count_used_parameters_in_backward needs torch's autograd-graph introspection, which "
                           f"torch {torch.__version__} lacks; fix: upgrade torch")
    if task_id() == -1:
        raise RuntimeError("count_used_parameters_in_backward: no backward pass is running; fix: call it from a "
                           "backward hook (a tensor's register_hook, a module's full backward hook)")
    accumulators = {}
    # hooks run with grad mode off, and the lookup of a leaf's accumulator needs it on
    with torch.enable_grad():
        for param in parameters:
            if isinstance(param, torch.Tensor) and param.requires_grad:
                node = lookup(param)
                if node is not None:
                    accumulators[id(node)] = node
    return sum(1 for node in accumulators.values() if will_run(node))
