"""shardwise: train PyTorch models from DeepSpeed ``ds_config.json`` files.

``import shardwise`` is instant: nothing here imports torch. The heavy parts load on
first use through module ``__getattr__``, so ``import shardwise as deepspeed`` works
in user scripts and costs nothing until ``initialize`` is called.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> (module, attribute or None for the module itself)
_LAZY: dict[str, tuple[str, str | None]] = {
    "ConfigError": ("shardwise.config.errors", "ConfigError"),
    "load_config": ("shardwise.config", "load_config"),
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
