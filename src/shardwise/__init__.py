"""shardwise: train PyTorch models from DeepSpeed ``ds_config.json`` files.

``import shardwise`` is instant: nothing here imports torch. The heavy parts load on
first use through module ``__getattr__``, so ``import shardwise as deepspeed`` works
in user scripts and costs nothing until ``initialize`` is called.

Example:
    >>> import shardwise as deepspeed
    >>> # engine, optimizer, loader, scheduler = deepspeed.initialize(model=model, config="ds_config.json")
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> (module, attribute or None for the module itself)
_LAZY: dict[str, tuple[str, str | None]] = {
    "initialize": ("shardwise.initialization", "initialize"),
    "add_config_arguments": ("shardwise.initialization", "add_config_arguments"),
    "init_distributed": ("shardwise.comm", "init_distributed"),
    "ShardwiseEngine": ("shardwise.engine", "ShardwiseEngine"),
    "DeepSpeedEngine": ("shardwise.engine", "ShardwiseEngine"),
    "ConfigError": ("shardwise.config.errors", "ConfigError"),
    "load_config": ("shardwise.config", "load_config"),
    "comm": ("shardwise.comm", None),
    "checkpointing": ("shardwise.checkpointing", None),
    "zero": ("shardwise.zero", None),
    "compression": ("shardwise.compression", None),
    "config": ("shardwise.config", None),
    "RepeatingLoader": ("shardwise.data", "RepeatingLoader"),
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module_name, attr = _LAZY[name]
        module = importlib.import_module(module_name)
        value = module if attr is None else getattr(module, attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'shardwise' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
