"""DeepSpeed's module-level constants that clients read (``VALID_LR_SCHEDULES``, the env file name)."""

from __future__ import annotations

VALID_LR_SCHEDULES: list[str] = ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
"""The five DeepSpeed schedulers by config name (``deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES``);
shardwise builds each with DeepSpeed's formulas (:mod:`shardwise.schedulers`)."""

DEEPSPEED_ENVIRONMENT_NAME = ".deepspeed_env"
"""The per-directory file of ``KEY=VALUE`` lines the launcher exports on every node
(``deepspeed.launcher.runner.DEEPSPEED_ENVIRONMENT_NAME``; shardwise also reads ``.shardwise_env``)."""
