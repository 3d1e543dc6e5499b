"""``deepspeed.utils.timer``'s timer names: DeepSpeed's spellings of shardwise's phase timers.

The engine times each phase under the names of :mod:`shardwise.profiling.timers` (``fwd``,
``bwd``, ...), per step and per micro step (``<name>_microstep``); these are the same strings under
DeepSpeed's constant names, so a client that reads or drives the engine's timers by them
(Megatron-DeepSpeed's zero-bubble engine: ``self.timers(BACKWARD_MICRO_TIMER).start()``) names the
timers shardwise keeps.
"""

from __future__ import annotations

from shardwise.profiling.timers import BACKWARD, BACKWARD_INNER, BACKWARD_REDUCE, FORWARD, MICRO_SUFFIX, STEP

FORWARD_GLOBAL_TIMER = FORWARD
FORWARD_MICRO_TIMER = FORWARD + MICRO_SUFFIX
BACKWARD_GLOBAL_TIMER = BACKWARD
BACKWARD_MICRO_TIMER = BACKWARD + MICRO_SUFFIX
BACKWARD_INNER_GLOBAL_TIMER = BACKWARD_INNER
BACKWARD_INNER_MICRO_TIMER = BACKWARD_INNER + MICRO_SUFFIX
BACKWARD_REDUCE_GLOBAL_TIMER = BACKWARD_REDUCE
BACKWARD_REDUCE_MICRO_TIMER = BACKWARD_REDUCE + MICRO_SUFFIX
STEP_GLOBAL_TIMER = STEP
STEP_MICRO_TIMER = STEP + MICRO_SUFFIX

__all__ = [
    "BACKWARD_GLOBAL_TIMER",
    "BACKWARD_INNER_GLOBAL_TIMER",
    "BACKWARD_INNER_MICRO_TIMER",
    "BACKWARD_MICRO_TIMER",
    "BACKWARD_REDUCE_GLOBAL_TIMER",
    "BACKWARD_REDUCE_MICRO_TIMER",
    "FORWARD_GLOBAL_TIMER",
    "FORWARD_MICRO_TIMER",
    "STEP_GLOBAL_TIMER",
    "STEP_MICRO_TIMER",
]
