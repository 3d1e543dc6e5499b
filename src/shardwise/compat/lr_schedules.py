"""``deepspeed.runtime.lr_schedules``' constants: the schedule names and their ``params`` keys.

The schedules themselves (``WarmupLR``, ``OneCycle``...) are :mod:`shardwise.schedulers`' classes with
DeepSpeed's formulas; :func:`get_lr_from_config` reads a ``scheduler`` section's starting LR as DeepSpeed does.
"""

from __future__ import annotations

from typing import Any

from shardwise.compat.constants import VALID_LR_SCHEDULES

__all__ = ["VALID_LR_SCHEDULES", "get_lr_from_config"]

LR_SCHEDULE = "lr_schedule"
LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR = VALID_LR_SCHEDULES

LR_RANGE_TEST_MIN_LR = "lr_range_test_min_lr"
LR_RANGE_TEST_STEP_RATE = "lr_range_test_step_rate"
LR_RANGE_TEST_STEP_SIZE = "lr_range_test_step_size"
LR_RANGE_TEST_STAIRCASE = "lr_range_test_staircase"

EDGE_VALUE, MID_VALUE = "edge_value", "mid_value"

CYCLE_FIRST_STEP_SIZE = "cycle_first_step_size"
CYCLE_FIRST_STAIR_COUNT = "cycle_first_stair_count"
CYCLE_SECOND_STEP_SIZE = "cycle_second_step_size"
CYCLE_SECOND_STAIR_COUNT = "cycle_second_stair_count"
DECAY_STEP_SIZE = "decay_step_size"
CYCLE_MIN_LR, CYCLE_MAX_LR, DECAY_LR_RATE = "cycle_min_lr", "cycle_max_lr", "decay_lr_rate"
CYCLE_MIN_MOM, CYCLE_MAX_MOM, DECAY_MOM_RATE = "cycle_min_mom", "cycle_max_mom", "decay_mom_rate"

WARMUP_MIN_LR, WARMUP_MAX_LR = "warmup_min_lr", "warmup_max_lr"
WARMUP_NUM_STEPS, WARMUP_TYPE = "warmup_num_steps", "warmup_type"
WARMUP_LOG_RATE, WARMUP_LINEAR_RATE = "log", "linear"
WARMUP_MIN_RATIO, COS_MIN_RATIO = "warmup_min_ratio", "cos_min_ratio"
TOTAL_NUM_STEPS = "total_num_steps"

_START_LR = {LR_RANGE_TEST: LR_RANGE_TEST_MIN_LR, ONE_CYCLE: CYCLE_MAX_LR, WARMUP_LR: WARMUP_MAX_LR,
             WARMUP_DECAY_LR: WARMUP_MAX_LR}


def get_lr_from_config(config: dict[str, Any]) -> tuple[Any, str]:
    """``(lr, "")`` from a ``scheduler`` section (``{"type": ..., "params": {...}}``), or ``(None, why)``."""
    if "type" not in config:
        return None, "the scheduler section has no 'type' key"
    if "params" not in config:
        return None, "the scheduler section has no 'params' key"
    kind, params = config["type"], config["params"]
    if kind not in VALID_LR_SCHEDULES:
        return None, f"{kind} is not a valid LR schedule"
    if kind == WARMUP_COSINE_LR:
        return None, f"{kind} sets its LR from the optimizer's; there is no LR key in its params"
    return params[_START_LR[kind]], ""
