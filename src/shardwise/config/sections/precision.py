"""fp16, bf16, legacy amp, torch_autocast and data_types sections (spec 3.5, 3.18)."""

from __future__ import annotations

import math
import numbers
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator

from shardwise.config.sections.base import OpenSection, Section


class FP16Config(Section):
    """``fp16``: half precision with dynamic (``loss_scale: 0``) or static loss scaling.

    The dynamic-scaling settings (``initial_scale_power``, ``loss_scale_window``, ``hysteresis``,
    ``min_loss_scale``) are checked where they are used, by
    :func:`shardwise.precision.build_loss_scaler`, and only when the run scales dynamically
    (``shardwise.config.checks``), as in DeepSpeed. As DeepSpeed's ``DeepSpeedFP16Config`` does, the
    section itself also refuses a ``loss_scale_window`` or ``min_loss_scale`` that is not a finite
    positive number when it is enabled and dynamic; a static scale or a disabled section keeps them
    as written (unused).
    """

    enabled: bool = False
    auto_cast: bool = False
    loss_scale: float = Field(0.0, ge=0)
    initial_scale_power: int = Field(16, ge=0)
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    # DeepSpeed 0.19.8 types this as int and rejects 1e-4; earlier releases took any
    # number and fractional minimums are meaningful, so we accept a positive float.
    min_loss_scale: float = 1.0
    fp16_master_weights_and_grads: bool = False

    @field_validator("loss_scale", mode="before")
    @classmethod
    def _finite_not_bool(cls, value: object) -> object:
        if isinstance(value, bool):
            raise ValueError("loss_scale must be a number (0 for dynamic scaling), not a boolean")
        if not isinstance(value, numbers.Real | str):  # numpy scalars are Real too
            raise ValueError(f"loss_scale must be a number (0 for dynamic scaling), not {type(value).__name__}")
        if isinstance(value, int | float) and not math.isfinite(value):
            raise ValueError("loss_scale must be finite")
        return value

    @field_validator("loss_scale_window", "min_loss_scale")
    @classmethod
    def _positive_when_dynamic(cls, value: float, info: ValidationInfo) -> float:
        # ``enabled`` and ``loss_scale`` are declared first, so they are in ``info.data`` when valid.
        dynamic = info.data.get("enabled") and info.data.get("loss_scale") == 0
        if dynamic and not (math.isfinite(value) and value > 0):
            raise ValueError(
                f"{info.field_name} must be a finite number > 0 under dynamic loss scaling "
                "(fp16 enabled with loss_scale 0)"
            )
        return value

    @property
    def dynamic(self) -> bool:
        """True when the loss scale adapts (``loss_scale == 0``)."""
        return self.loss_scale == 0


class BF16Config(Section):
    """``bf16`` (alias ``bfloat16``): bfloat16 compute with fp32 master weights."""

    enabled: bool = False
    immediate_grad_update: bool = False
    check_grad_overflow: bool = True
    bf16_master_weights_and_grads: bool = False
    bf16_optimizer_states: bool = False


class AmpConfig(OpenSection):
    """Legacy ``amp`` (apex). We map it onto ``torch.autocast``; apex options such as
    ``opt_level`` are accepted and recorded (O1/O2 both mean autocast to fp16 here)."""

    enabled: bool = False
    opt_level: str = "O1"


class TorchAutocastConfig(Section):
    """``torch_autocast``: autocast the forward to ``dtype``."""

    enabled: bool = False
    dtype: str = "bfloat16"
    lower_precision_safe_modules: list[str] | None = None

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype_alias(cls, value: object) -> object:
        aliases = {
            "bfloat16": "bfloat16",
            "bf16": "bfloat16",
            "torch.bfloat16": "bfloat16",
            "float16": "float16",
            "fp16": "float16",
            "half": "float16",
            "torch.float16": "float16",
            "torch.half": "float16",
        }
        if isinstance(value, str) and value.lower() in aliases:
            return aliases[value.lower()]
        raise ValueError(f"dtype must be one of {sorted(set(aliases))}")


DTypeName = Literal["fp32", "fp16", "bf16"]


class DataTypesConfig(Section):
    """``data_types``: gradient accumulation and parameter dtypes."""

    grad_accum_dtype: DTypeName | None = None
    param_dtype: DTypeName | None = None
    buffer_dtype: DTypeName | None = None
    keep_in_fp32_modules: str | list[str] = "auto"

    @field_validator("grad_accum_dtype", "param_dtype", "buffer_dtype", mode="before")
    @classmethod
    def _dtype_names(cls, value: object) -> object:
        aliases = {
            "fp32": "fp32",
            "float32": "fp32",
            "float": "fp32",
            "fp16": "fp16",
            "float16": "fp16",
            "half": "fp16",
            "bf16": "bf16",
            "bfloat16": "bf16",
        }
        if isinstance(value, str):
            if value.lower() not in aliases:
                raise ValueError(f"must be one of 'fp32', 'fp16', 'bf16' (got {value!r})")
            return aliases[value.lower()]
        return value
