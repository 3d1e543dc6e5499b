"""DeepSpeed's module-level constants that clients read (``VALID_LR_SCHEDULES``, the env file name)."""

from __future__ import annotations

VALID_LR_SCHEDULES: list[str] = ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
"""The five DeepSpeed schedulers by config name (``deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES``);
shardwise builds each with DeepSpeed's formulas (:mod:`shardwise.schedulers`)."""

DEEPSPEED_ENVIRONMENT_NAME = ".deepspeed_env"
"""The per-directory file of ``KEY=VALUE`` lines the launcher exports on every node
(``deepspeed.launcher.runner.DEEPSPEED_ENVIRONMENT_NAME``; shardwise also reads ``.shardwise_env``)."""

# ``deepspeed.checkpoint.constants``: the keys of DeepSpeed's universal-checkpoint description a model
# carries. shardwise's checkpoints hold whole tensors already (tensor-parallel slices are saved as
# chunks of the whole tensor), so it writes no such description; the keys are importable for scripts.
UNIVERSAL_CHECKPOINT_INFO = "universal_checkpoint_info"
ORIGINAL_VOCAB_SIZE = "original_vocab_size"
VOCABULARY_PARAMETER_PATTERNS = "vocabulary_parameter_patterns"
PARAMETER_WITH_ROW_PARALLELISM_PATTERNS = "parameter_with_row_parallelism_patterns"
TP_REPLICATED_PARAMETER_PATTERNS = "tp_replicated_parameter_patterns"
