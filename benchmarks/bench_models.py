"""The benchmark model module, loaded by file path in a benchmark's rank processes (standard
library only: the DeepSpeed venv, where the workers also run, has no shardwise to import)."""

from __future__ import annotations

import importlib.util
import sys
import types


def load_models(path: str) -> types.ModuleType:
    """Load ``shardwise/testing/models.py`` from ``path`` as ``_bench_models``."""
    spec = importlib.util.spec_from_file_location("_bench_models", path)
    assert spec is not None and spec.loader is not None, f"cannot load {path}"
    module = importlib.util.module_from_spec(spec)
    sys.modules["_bench_models"] = module  # dataclasses look the module up while building
    spec.loader.exec_module(module)
    return module
