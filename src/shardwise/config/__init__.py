"""The config system: one pydantic model per ds_config.json section, batch rules,
``"auto"`` resolution and provenance. Pure: no torch.distributed.

Example:
    >>> from shardwise.config import load_config
    >>> cfg = load_config({"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True}}, world_size=2)
    >>> cfg.batch.train_batch_size, cfg.config.precision
    (8, 'bf16')
"""

from shardwise.config.auto import ResolutionContext
from shardwise.config.batch import BatchSizes, resolve_batch_sizes
from shardwise.config.errors import ConfigError, ConfigErrors, did_you_mean
from shardwise.config.model import ShardwiseConfig
from shardwise.config.provenance import Provenance, Source
from shardwise.config.resolve import ResolvedConfig, load_config

__all__ = [
    "BatchSizes",
    "ConfigError",
    "ConfigErrors",
    "Provenance",
    "ResolutionContext",
    "ResolvedConfig",
    "ShardwiseConfig",
    "Source",
    "did_you_mean",
    "load_config",
    "resolve_batch_sizes",
]
