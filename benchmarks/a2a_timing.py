"""What the MoE benchmark workers share (``moe_worker.py``, ``autoep_folding_worker.py``): the bytes
handed to ``all_to_all_single`` (counted by wrapping it in ``torch.distributed``, which both libraries
call through the module at call time; importing this module installs the wrapper) and the timed step loop."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

SENT = {"bytes": 0, "calls": 0}
_original = dist.all_to_all_single


def _counting(*args: Any, **kwargs: Any) -> Any:
    tensor = kwargs["input"] if "input" in kwargs else args[1]
    SENT["bytes"] += tensor.numel() * tensor.element_size()
    SENT["calls"] += 1
    return _original(*args, **kwargs)


dist.all_to_all_single = _counting


def timed_steps(step: Callable[[], float], warmup: int, steps: int) -> dict[str, list[float]]:
    """Run ``step`` (one training step, returning its loss) ``warmup + steps`` times after a barrier each;
    the CPU and wall seconds and all-to-all bytes of the last ``steps``, and every loss."""
    out: dict[str, list[float]] = {"cpu": [], "wall": [], "sent": [], "losses": []}
    for i in range(warmup + steps):
        before = SENT["bytes"]
        dist.barrier()
        c0, w0 = time.process_time(), time.perf_counter()
        out["losses"].append(step())
        c1, w1 = time.process_time(), time.perf_counter()
        if i >= warmup:
            out["cpu"].append(c1 - c0)
            out["wall"].append(w1 - w0)
            out["sent"].append(SENT["bytes"] - before)
    return out
