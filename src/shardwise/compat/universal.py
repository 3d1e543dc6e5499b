"""``deepspeed.checkpoint``'s universal-checkpoint names on shardwise's converter
(:mod:`shardwise.checkpoint.universal_write`): ``UNIVERSAL_CHECKPOINT_INFO`` and
``ds_to_universal.main(args)``.

``main`` takes ``ds_to_universal``'s arguments (``input_folder``: a checkpoint's tag directory,
``output_folder``: ``<dir>/<tag>``; ``latest_universal`` goes to ``<dir>``) and converts a native
DeepSpeed or a shardwise checkpoint. Its worker-count, temp-folder and strictness options concern
DeepSpeed's multi-process extraction, which this converter does not have: they are accepted and
have no effect (it reads each tensor once, in one process).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardwise.checkpoint.universal_names import UNIVERSAL_INFO

UNIVERSAL_CHECKPOINT_INFO = UNIVERSAL_INFO

__all__ = ["UNIVERSAL_CHECKPOINT_INFO", "main"]


def main(args: Any) -> Path:
    """Convert ``args.input_folder`` to the universal layout in ``args.output_folder`` (DeepSpeed's API).

    Example:
        >>> # from deepspeed.checkpoint.ds_to_universal import main
        >>> # main(SimpleNamespace(input_folder="ckpt/global_step3", output_folder="uni/global_step3"))
    """
    from shardwise.checkpoint.universal_write import shardwise_to_universal

    out = Path(args.output_folder)
    return shardwise_to_universal(args.input_folder, out.parent, out_tag=out.name)
