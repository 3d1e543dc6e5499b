"""``deepspeed.runtime.zero.config``: DeepSpeed's ZeRO config models over shardwise's ``zero_optimization``.

``DeepSpeedZeroConfig(**section)`` parses and validates a section exactly as shardwise does
(:class:`~shardwise.config.sections.zero.ZeroConfig`, legacy spellings through
:func:`~shardwise.config.compat.normalize_legacy`: ``cpu_offload``, ``cpu_offload_param``,
``stage3_gather_fp16_weights_on_model_save``, the short stage-3 names) and reads with DeepSpeed's
attribute names too (``prefetch_bucket_size``, ``gather_16bit_weights_on_model_save``...;
``overlap_comm`` resolved: on at stage 3 unless set). ``deepspeed.runtime.zero.leaf_module_config`` is here
too: ``DeepSpeedZeroLeafModuleConfig`` is shardwise's ``zero_optimization.leaf_module`` section and the
``DEFAULT_LEAF_MODULE_*`` lists its defaults.
"""

from __future__ import annotations

from typing import Any

from shardwise.config.compat import STAGE3_ALIASES, normalize_legacy
from shardwise.config.sections.zero import (
    DEFAULT_LEAF_MODULE_CLASSES as _LEAF_CLASSES,
)
from shardwise.config.sections.zero import (
    AioConfig,
    LeafModuleConfig,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    ZeroConfig,
)
from shardwise.utils.logging import logger
from shardwise.zero.offload_states import OffloadDevice, OffloadStateType

__all__ = [
    "DEFAULT_LEAF_MODULE_CLASSES",
    "DEFAULT_LEAF_MODULE_NAMES",
    "DEFAULT_LEAF_MODULE_NAME_SUFFIXES",
    "DeepSpeedZeroConfig",
    "DeepSpeedZeroLeafModuleConfig",
    "DeepSpeedZeroOffloadOptimizerConfig",
    "DeepSpeedZeroOffloadParamConfig",
    "OffloadDeviceEnum",
    "OffloadStateTypeEnum",
    "ZeroStageEnum",
    "read_zero_config_deprecated",
]


DeepSpeedZeroLeafModuleConfig = LeafModuleConfig
DEFAULT_LEAF_MODULE_CLASSES: list[str] = list(_LEAF_CLASSES)
DEFAULT_LEAF_MODULE_NAMES: list[str] = []
DEFAULT_LEAF_MODULE_NAME_SUFFIXES: list[str] = []
"""The ``leaf_module`` section's defaults as lists (what the section holds), by DeepSpeed's names."""


class ZeroStageEnum:
    """The ZeRO stages by DeepSpeed's names."""

    disabled, optimizer_states, gradients, weights = 0, 1, 2, 3
    max_stage = 3


OffloadDeviceEnum = OffloadDevice
"""Where ZeRO offloads to (``none``, ``cpu``, ``nvme``; str-valued)."""
OffloadStateTypeEnum = OffloadStateType
"""The states ``engine.offload_states(include=...)`` moves (:mod:`shardwise.zero.offload_states`)."""


class DeepSpeedZeroOffloadParamConfig(OffloadParamConfig):
    """``zero_optimization.offload_param``."""


class DeepSpeedZeroOffloadOptimizerConfig(OffloadOptimizerConfig):
    """``zero_optimization.offload_optimizer``; ``pipeline`` is ``pipeline_read or pipeline_write``."""

    @property
    def pipeline(self) -> bool:
        """Whether NVMe reads or writes overlap the optimizer step."""
        return self.pipeline_read or self.pipeline_write


class DeepSpeedZeroConfig(ZeroConfig):
    """``zero_optimization`` as DeepSpeed's model: shardwise's validation, DeepSpeed's attribute names."""

    offload_param: DeepSpeedZeroOffloadParamConfig | None = None
    offload_optimizer: DeepSpeedZeroOffloadOptimizerConfig | None = None

    def __init__(self, **section: Any) -> None:
        raw = {"zero_optimization": dict(section)}
        normalize_legacy(raw)
        super().__init__(**raw["zero_optimization"])
        if self.overlap_comm is None:
            self.overlap_comm = self.overlap_comm_effective
        if self.stage == 3 and self.elastic_checkpoint:
            logger.warning(
                "zero_optimization.elastic_checkpoint: elastic checkpointing is deprecated for ZeRO stage 3 and has "
                "no effect; shardwise's checkpoints load at any world size and stage whatever it says"
            )

    def __getattr__(self, name: str) -> Any:
        long_name = STAGE3_ALIASES.get(name)
        if long_name is not None and long_name != name:
            return getattr(self, long_name)
        return super().__getattr__(name)  # type: ignore[misc]


def read_zero_config_deprecated(param_dict: dict[str, Any]) -> dict[str, Any]:
    """The old boolean ``zero_optimization`` form as a section dict (``{"stage": 1}`` or ``{"stage": 0}``)."""
    raw = {"zero_optimization": param_dict.get("zero_optimization", False)}
    normalize_legacy(raw)
    return raw["zero_optimization"]


DeepSpeedAIOConfig = AioConfig
"""``aio``."""
