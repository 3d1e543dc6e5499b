"""``deepspeed.checkpoint.constants`` (also ``deepspeed.checkpoint``): the keys of the universal-checkpoint
description a client stores in its checkpoints (Megatron-DeepSpeed: ``state_dict[UNIVERSAL_CHECKPOINT_INFO]``,
the vocabulary sizes and the patterns of its tensor-parallel parameters), with DeepSpeed's values.
What shardwise's converter does with them (docs/checkpoints.md, "Universal checkpoints"): it keeps the
description in the converted model file; the patterns tell DeepSpeed how to merge tensor-parallel slices,
and shardwise's checkpoints hold whole tensors already (a DeepSpeed checkpoint with mp size > 1 is refused),
so no pattern changes a tensor; vocabulary padding is not stripped (load with the same padded size).
"""

from __future__ import annotations

UNIVERSAL_CHECKPOINT_INFO = "universal_checkpoint_info"
UNIVERSAL_CHECKPOINT_VERSION_KEY = "universal_checkpoint_version"
UNIVERSAL_CHECKPOINT_VERSION_VALUE = 0.4
"""The description's version DeepSpeed 0.19.8 writes; a client stores it under the key above."""
VOCAB_TENSOR = "vocab_tensor"
PADDED_VOCAB_SIZE = "padded_vocab_size"
ORIGINAL_VOCAB_SIZE = "original_vocab_size"
VOCABULARY_PARAMETER_PATTERNS = "vocabulary_parameter_patterns"
PIPELINE_REPLICATED_PARAMETER_PATTERNS = "pipeline_replicated_parameter_patterns"
PARAMETER_TO_AVERAGE_PATTERNS = "parameter_to_average_patterns"
PARAMETER_WITH_ROW_PARALLELISM_PATTERNS = "parameter_with_row_parallelism_patterns"
TP_REPLICATED_PARAMETER_PATTERNS = "tp_replicated_parameter_patterns"
PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0 = "parameter_with_2_sub_params_cat_dim_0"
PARAMETER_WITH_SUB_PARAMS = "parameter_with_sub_params"
