"""DeepSpeed's compression library (``compression_training``) on plain PyTorch modules.

``shardwise.compression.compress`` holds the two entry points with DeepSpeed's names:
``init_compression`` swaps the matched ``Linear``/``Conv2d``/``Embedding`` modules for
compression-aware ones (:mod:`.layers`), ``redundancy_clean`` bakes quantized weights and
physically removes pruned rows, heads and channels (:mod:`.clean`). Each technique lives in its
own module (:mod:`.weight_quant`, :mod:`.activation_quant`, :mod:`.sparse_pruning`,
:mod:`.row_pruning`, :mod:`.head_pruning`, :mod:`.channel_pruning`, :mod:`.layer_reduction`);
:mod:`.scheduler` turns them on at their ``schedule_offset`` and the engine advances it every
optimizer step through :mod:`.hook` (a step hook, so its state is checkpointed).

Nothing here is imported by ``import shardwise`` (no torch at package import).
"""
