"""``deepspeed.runtime.config``: ``DeepSpeedConfig`` (a ds_config read and validated by shardwise, with
DeepSpeed's attribute names), ``deepspeed.runtime.precision_config``'s section models and readers
(``DeepSpeedFP16Config`` / ``DeepSpeedBF16Config`` are shardwise's ``fp16`` / ``bf16`` sections), and the
optimizer-name constants. ``expert_parallel_config`` is the ``expert_parallel`` section as
:class:`~shardwise.autoep.config.AutoEPConfig` (a ``load_balance_coeff`` other than null refused).

``DeepSpeedConfig(path_or_dict)`` is :func:`shardwise.config.load_config` (every check shardwise makes,
errors with key, value, rule and fix; a duplicate key is refused) for this process's data-parallel
world size; ``config.resolved`` is the :class:`~shardwise.config.resolve.ResolvedConfig`.
"""

from __future__ import annotations

import os
from typing import Any

from shardwise.autoep.config import AutoEPConfig, parse_autoep_config
from shardwise.comm import get_rank, get_world_size, is_initialized
from shardwise.compat.monitors import DeepSpeedMonitorConfig
from shardwise.compat.runtime_constants import get_top_level_setting
from shardwise.compat.zero_config import DeepSpeedZeroConfig
from shardwise.config import load_config
from shardwise.config.loading import read_config_source
from shardwise.config.resolve import ResolvedConfig
from shardwise.config.sections.precision import BF16Config, FP16Config

ADAGRAD_OPTIMIZER, ADAM_OPTIMIZER, ADAMW_OPTIMIZER, LAMB_OPTIMIZER = "adagrad", "adam", "adamw", "lamb"
ONEBIT_ADAM_OPTIMIZER, ZERO_ONE_ADAM_OPTIMIZER, ONEBIT_LAMB_OPTIMIZER = "onebitadam", "zerooneadam", "onebitlamb"
LION_OPTIMIZER, MUON_OPTIMIZER = "lion", "muon"
DEEPSPEED_OPTIMIZERS = [ADAGRAD_OPTIMIZER, ADAM_OPTIMIZER, ADAMW_OPTIMIZER, LAMB_OPTIMIZER, ONEBIT_ADAM_OPTIMIZER,
                        ONEBIT_LAMB_OPTIMIZER, ZERO_ONE_ADAM_OPTIMIZER, LION_OPTIMIZER, MUON_OPTIMIZER]
"""The optimizer ``type`` names DeepSpeed builds itself (shardwise builds each: :mod:`shardwise.optim`)."""
TORCH_ADAM_PARAM, ADAM_W_MODE, ADAM_W_MODE_DEFAULT = "torch_adam", "adam_w_mode", True


DeepSpeedFP16Config = FP16Config
DeepSpeedBF16Config = BF16Config


def get_bfloat16_config(param_dict: dict[str, Any]) -> BF16Config:
    """The ``bf16`` section (or its old name ``bfloat16``) of a config dict, validated."""
    section = param_dict.get("bf16", param_dict.get("bfloat16", {}))
    return BF16Config(**section)


def get_gradient_clipping(param_dict: dict[str, Any]) -> float:
    """``gradient_clipping`` of a config dict (absent: the default, 1.0)."""
    return float(get_top_level_setting(param_dict, "gradient_clipping"))


def get_log_level(param_dict: dict[str, Any]) -> str | None:
    """``log_level`` of a config dict, as written (absent: None, the logger's level left alone)."""
    level = get_top_level_setting(param_dict, "log_level")
    return None if level is None else str(level)


def get_float16_config(param_dict: dict[str, Any]) -> FP16Config:
    """The ``fp16`` section of a config dict, validated."""
    return FP16Config(**param_dict.get("fp16", {}))


class DeepSpeedConfig:
    """A ds_config (path, dict, or JSON/base64 text) resolved by shardwise, read with DeepSpeed's names."""

    def __init__(self, config: Any, mpu: Any = None, mesh_device: Any = None) -> None:
        self._param_dict, _ = read_config_source(config)
        self.global_rank = get_rank() if is_initialized() else 0
        self.world_size = get_world_size() if is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
        if mpu is not None:
            self.world_size = mpu.get_data_parallel_world_size()
        self.resolved: ResolvedConfig = load_config(self._param_dict, world_size=self.world_size)
        cfg = self.resolved.config
        batch = self.resolved.batch
        self.train_batch_size = batch.train_batch_size
        self.train_micro_batch_size_per_gpu = batch.micro_batch_per_gpu
        self.gradient_accumulation_steps = batch.gradient_accumulation_steps
        self.zero_config = DeepSpeedZeroConfig(**self._param_dict.get("zero_optimization", {}) or {}) \
            if isinstance(self._param_dict.get("zero_optimization", {}), dict) else DeepSpeedZeroConfig()
        section = self._param_dict.get("expert_parallel")
        self.expert_parallel_config: AutoEPConfig = parse_autoep_config(section if isinstance(section, dict) else None)
        self.zero_optimization_stage = cfg.zero_optimization.stage
        self.zero_enabled = self.zero_optimization_stage > 0
        self.monitor_config = DeepSpeedMonitorConfig(
            tensorboard=cfg.tensorboard, wandb=cfg.wandb, csv_monitor=cfg.csv_monitor, comet=cfg.comet
        )
        self.bfloat16_config = cfg.bf16
        self.float16_config = cfg.fp16
        self.fp16_enabled, self.bfloat16_enabled = cfg.fp16.enabled, cfg.bf16.enabled
        optimizer, scheduler = cfg.optimizer, cfg.scheduler
        self.optimizer_name = optimizer.type.lower() if optimizer is not None and optimizer.type else None
        self.optimizer_params = dict(optimizer.params) if optimizer is not None else None
        self.scheduler_name = scheduler.type if scheduler is not None else None
        self.scheduler_params = dict(scheduler.params) if scheduler is not None else None
        eigenvalue = cfg.eigenvalue
        for name in ("enabled", "verbose", "max_iter", "tol", "stability", "gas_boundary_resolution",
                     "layer_name", "layer_num"):
            value = getattr(eigenvalue, name, None) if eigenvalue is not None else None
            default = {"enabled": False, "verbose": False}.get(name)
            setattr(self, f"eigenvalue_{name}", default if value is None else value)

    def __getattr__(self, name: str) -> Any:
        """Any other top-level setting by its DeepSpeed key (``gradient_clipping``, ``steps_per_print``...)."""
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return getattr(self.resolved.config, name)
        except AttributeError:
            raise AttributeError(
                f"DeepSpeedConfig has no attribute {name!r} in shardwise; read the setting from "
                "config.resolved.config (the typed sections) or config._param_dict"
            ) from None

    def print(self, name: str) -> None:
        """Log the resolved config under ``name``."""
        from shardwise.utils.logging import logger

        logger.info("%s: %s", name, self.resolved.to_ds_dict())
