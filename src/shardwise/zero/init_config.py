"""What ``zero.Init`` reads from a config before the engine exists: the parameter dtype and, for
``remote_device="nvme"``, where the chunks' file goes (``offload_param.nvme_path``).

Only these keys are read, not the whole config: batch keys may need the world size and
``"auto"`` values the model, neither of which exists yet.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from shardwise.zero.nvme import AioSettings, MappedStash, swap_directory


def file_stash(remote_device: str | None, config: Any, rank: int) -> MappedStash | None:
    """``remote_device="nvme"``: chunks go to a file under ``offload_param.nvme_path`` as they are
    made (DeepSpeed's ZeRO-Infinity construction), so building a model larger than memory works."""
    if remote_device != "nvme":
        return None
    from shardwise.config.loading import read_config_source

    raw = read_config_source(config)[0] if config is not None else {}
    zero = raw.get("zero_optimization") if isinstance(raw, dict) else None
    block = zero.get("offload_param") if isinstance(zero, dict) else None
    path = block.get("nvme_path") if isinstance(block, dict) else None
    if not path:
        raise ValueError(
            "zero.Init(remote_device='nvme') keeps parameter chunks in files under "
            "zero_optimization.offload_param.nvme_path, which the config does not set "
            f"(got {path!r}); pass config_dict_or_path= a config with offload_param "
            '{"device": "nvme", "nvme_path": "/local_nvme"}, or use remote_device="cpu"'
        )
    return MappedStash(swap_directory(Path(path), "init", rank), AioSettings())


def config_dtype(config: Any) -> torch.dtype | None:
    """The parameter dtype a config trains in: fp16, bf16, else fp32 (None without a config).

    Only the precision flags are read, not the whole config: batch keys may need the
    world size and ``"auto"`` values the model, neither of which exists yet.
    """
    if config is None:
        return None
    from shardwise.config.loading import read_config_source

    raw, _ = read_config_source(config)

    def enabled(*names: str) -> bool:
        for name in names:
            block = raw.get(name)
            if isinstance(block, dict) and block.get("enabled") in (True, "true", "True", 1):
                return True
        return False

    if enabled("fp16"):
        return torch.float16
    if enabled("bf16", "bfloat16"):
        return torch.bfloat16
    return torch.float32
