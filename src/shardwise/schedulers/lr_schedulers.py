"""DeepSpeed's five LR schedulers as thin wrappers that copy pure formulas into an optimizer.

The classes keep DeepSpeed's names and constructor signatures so that ``ds_config.json``
``"scheduler": {"type": ..., "params": {...}}`` blocks and user code written against
``deepspeed.runtime.lr_schedules`` work unchanged. The maths lives in
:mod:`shardwise.schedulers.formulas`; a wrapper holds one schedule per param group.

Behaviour shared by all five (spec section 4.1):

* Construction writes the LR for ``last_batch_iteration`` into the optimizer at once (the
  first optimizer update uses it). At the default ``-1`` this is ``warmup_min_lr`` for the
  warmup schedulers, 0.0 for WarmupCosineLR, and ``cycle_min_lr``/``lr_range_test_min_lr``.
* ``step()`` advances one iteration; ``step(k)`` jumps to iteration ``k``.
* ``state_dict()`` is exactly ``{"last_batch_iteration": i}``; ``load_state_dict`` restores
  only that and leaves the optimizer alone until the next ``step()``.
* Scalar min/max values are broadcast to every param group; lists must have one value
  per group.
* They are not ``torch.optim.lr_scheduler.LRScheduler`` subclasses, like DeepSpeed's: they
  do not patch ``optimizer.step`` or add ``initial_lr`` to param groups.
"""

from __future__ import annotations

from shardwise.schedulers.cyclic_schedulers import LRRangeTest, OneCycle
from shardwise.schedulers.optimizer_access import unwrap_optimizer
from shardwise.schedulers.scheduler_base import per_group
from shardwise.schedulers.scheduler_base import update_lr as update_lr  # re-exported: its old home
from shardwise.schedulers.warmup_schedulers import WarmupCosineLR, WarmupDecayLR, WarmupLR

__all__ = [
    "LRRangeTest",
    "OneCycle",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "per_group",
    "unwrap_optimizer",
]
