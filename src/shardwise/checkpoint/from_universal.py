"""Convert a universal checkpoint (DeepSpeed's ``ds_to_universal`` layout) to a shardwise checkpoint.

``shardwise checkpoint from-universal UNIVERSAL OUT`` writes a regular shardwise checkpoint (DCP
files, summary with checksums, ``latest``), one process, no process group: whole tensors, as a
single-rank stage-0 save writes them, which any world size and stage then loads. Trainable
parameters take their fp32 values from ``zero/<param>/fp32.pt``; in 16-bit models those are the
``master/`` entries and the module entries are their 16-bit casts.

Example:
    >>> # universal_to_shardwise("universal", "ckpts")   # -> Path("ckpts/global_step3")
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any

import torch

from shardwise.checkpoint import integrity, keys, layout, publish
from shardwise.checkpoint.universal_names import DS_VERSION
from shardwise.checkpoint.universal_read import UniversalCheckpoint


def universal_to_shardwise(
    universal: str | os.PathLike[str], out_dir: str | os.PathLike[str], *, tag: str | None = None
) -> Path:
    """Write the universal checkpoint ``universal`` (its ``latest_universal`` tag, or ``tag``) as a
    shardwise checkpoint ``out_dir/<tag>`` and point ``out_dir/latest`` at it.

    Raises:
        CheckpointIntegrityError: a file of the universal checkpoint is damaged.
        FileNotFoundError, ValueError: not a universal checkpoint.
    """
    from shardwise import __version__

    tag_dir = layout.resolve(universal, tag, latest_name=layout.LATEST_UNIVERSAL)
    integrity.require_intact(tag_dir)
    ckpt = UniversalCheckpoint(tag_dir)
    module = ckpt.module_state_dict()
    optimizer = ckpt.optimizer_state()
    items: dict[str, Any] = {keys.model_key(k): v for k, v in module.items()}
    for key, value in optimizer.items():
        name = key[len(keys.MASTER) :] if key.startswith(keys.MASTER) else None
        if name is not None and module[name].dtype == torch.float32:
            continue  # an fp32 parameter is its own master (the module entry holds the value)
        items[key] = value
    counters = ckpt.counters()
    client = {k: v for k, v in ckpt.model.items() if k not in _MODEL_STATE_KEYS}
    ds_config = dict(ckpt.model.get("ds_config") or {})
    scaler = ckpt.saved_loss_scaler()
    items[keys.COMMON] = {
        "counters": {
            **counters,
            "micro_steps": counters["global_steps"]
            * int(ds_config.get("gradient_accumulation_steps", 1) or 1),
        },
        "lr_scheduler": ckpt.model.get("lr_scheduler"),
        "loss_scaler": scaler if isinstance(scaler, dict) else None,
        "step_hooks": {},
        "client_state": client,
        "ds_config": ds_config,
        "exclude_frozen_parameters": False,
        "tag": tag_dir.name,
    }
    trainable = {n for g in optimizer[keys.PARAM_GROUPS] for n in g[keys.PARAM_NAMES]}
    frozen = [n for n in ckpt.frozen_shapes if n in module]
    summary = {
        "module_keys": list(module),
        "frozen": frozen,
        "aliases": {},
        "format": keys.FORMAT,
        "format_version": keys.FORMAT_VERSION,
        "shardwise_version": __version__,
        "tag": tag_dir.name,
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "counters": items[keys.COMMON]["counters"],
        "zero_stage": ckpt.stage,
        "world_size": 1,
        "dp_world_size": 1,
        "mp_world_size": 1,
        "param_dtypes": sorted(
            {str(module[n].dtype).removeprefix("torch.") for n in trainable | set(frozen)}
        ),
        "trainable_parameters": sum(math.prod(module[n].shape) for n in trainable),
        "frozen_parameters": sum(math.prod(module[n].shape) for n in frozen),
        "exclude_frozen_parameters": False,
        "fp32_masters_saved": any(k.startswith(keys.MASTER) for k in items),
        "optimizer": None,
        "converted_from": {
            "universal": str(tag_dir),
            "ds_version": ckpt.optim.get("ds_version") or DS_VERSION,
        },
    }
    root = Path(out_dir)
    layout.prepare_staging(root, tag_dir.name)
    publish.write_and_publish(items, root, tag_dir.name, summary, save_latest=True, group=None)
    return root / tag_dir.name


# model-states keys that are DeepSpeed's own, not the client's (the rest is client state)
_MODEL_STATE_KEYS = frozenset(
    {
        "module",
        "buffer_names",
        "optimizer",
        "param_shapes",
        "frozen_param_shapes",
        "shared_params",
        "frozen_param_fragments",
        "lr_scheduler",
        "data_sampler",
        "random_ltd",
        "skipped_steps",
        "global_steps",
        "global_samples",
        "dp_world_size",
        "mp_world_size",
        "checkpoint_parallel_dimensions",
        "ds_config",
        "ds_version",
        "universal_checkpoint_info",
        "shardwise_version",
    }
)
