"""DeepSpeed's compression library (``compression_training``) on plain PyTorch modules.

``shardwise.compression.compress`` holds the two entry points with DeepSpeed's names:
``init_compression`` swaps the matched ``Linear``/``Conv2d``/``Embedding`` modules for
compression-aware ones (:mod:`.layers`), ``redundancy_clean`` bakes quantized weights and
physically removes pruned rows, heads and channels (:mod:`.clean`). Each technique lives in its
own module (:mod:`.weight_quant`, :mod:`.activation_quant`, :mod:`.sparse_pruning`,
:mod:`.row_pruning`, :mod:`.head_pruning`, :mod:`.channel_pruning`, :mod:`.layer_reduction`);
:mod:`.scheduler` turns them on at their ``schedule_offset`` and the engine advances it every
optimizer step through :mod:`.hook` (a step hook, so its state is checkpointed).

Nothing here is imported by ``import shardwise`` (no torch at package import). As in DeepSpeed,
``shardwise.compression.init_compression`` and ``redundancy_clean`` are also reachable here, and
``deepspeed.compression.compress.init_compression`` works after ``import shardwise as deepspeed``.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["compress", "init_compression", "redundancy_clean"]


def __getattr__(name: str) -> Any:
    if name in ("init_compression", "redundancy_clean"):
        return getattr(importlib.import_module("shardwise.compression.compress"), name)
    if name == "compress":
        return importlib.import_module("shardwise.compression.compress")
    raise AttributeError(f"module 'shardwise.compression' has no attribute {name!r}")
