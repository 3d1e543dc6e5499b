"""Package-level promises: importing is instant (no torch), public names resolve."""

from __future__ import annotations

import subprocess
import sys


def _modules_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(out.split())


def test_import_shardwise_loads_neither_torch_nor_pydantic():
    loaded = _modules_after("import shardwise")
    assert "torch" not in loaded and "pydantic" not in loaded


def test_config_package_is_pure():
    loaded = _modules_after("import shardwise.config; shardwise.config.load_config({'train_batch_size': 8})")
    assert "torch" not in loaded and "torch.distributed" not in loaded


def test_public_api_names_resolve():
    import shardwise

    for name in (
        "initialize",
        "add_config_arguments",
        "init_distributed",
        "ConfigError",
        "load_config",
        "RepeatingLoader",
        "DeepSpeedEngine",
    ):
        assert getattr(shardwise, name) is not None
    assert callable(shardwise.initialize) and shardwise.initialize.__name__ == "initialize"
    assert set(shardwise.__all__) >= {
        "initialize",
        "init_distributed",
        "add_config_arguments",
        "comm",
        "zero",
    }
