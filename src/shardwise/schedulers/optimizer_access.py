"""The torch optimizer a scheduler writes into, found behind engine and ZeRO wrappers."""

from __future__ import annotations

from typing import Any

import torch


def unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """Return the torch optimizer behind ``optimizer``, following ``.optimizer`` attributes.

    Engines and ZeRO wrappers expose the real optimizer as ``.optimizer``; schedulers must
    write into the param groups the update actually reads.

    Raises:
        ValueError: if no object in the chain has ``param_groups``.
    """
    current = optimizer
    for _ in range(16):  # a bounded walk: a cycle of .optimizer references would otherwise hang
        if isinstance(current, torch.optim.Optimizer):
            return current
        inner = getattr(current, "optimizer", None)
        if inner is None:
            break
        current = inner
    if hasattr(current, "param_groups") and hasattr(current, "defaults"):
        return current  # duck-typed optimizer (e.g. a custom class not deriving from Optimizer)
    raise ValueError(
        f"a scheduler needs a torch optimizer, got {type(optimizer).__name__}: it is not a "
        "torch.optim.Optimizer and has no .optimizer attribute leading to one. Fix: pass the optimizer "
        "(or the object returned by shardwise.initialize, whose .optimizer is used)."
    )
