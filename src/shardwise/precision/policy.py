"""The precision policy: parameter dtype, autocast, loss scaling, overflow checks.

Chosen once from the config by ``build_precision``; the engine and ZeRO only ask it.

| config                         | params | master | forward            | loss scaling |
|--------------------------------|--------|--------|--------------------|--------------|
| (none)                         | fp32   | -      | plain              | none         |
| ``bf16.enabled``               | bf16   | fp32   | plain (bf16)       | none         |
| ``fp16.enabled``               | fp16   | fp32   | plain (fp16)       | dynamic / static |
| ``amp.enabled`` (legacy apex)  | fp32   | -      | autocast(fp16)     | dynamic      |
| ``torch_autocast.enabled``     | fp32   | -      | autocast(dtype)    | dynamic if fp16 |

Gradients accumulate in fp32 unless ``data_types.grad_accum_dtype`` says otherwise
(DeepSpeed accumulates 16-bit models' gradients in the model dtype at stage 0; fp32 is
more accurate and is what its ZeRO stages hold in their partitions).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from shardwise.config.sections.precision import (
    AmpConfig,
    BF16Config,
    DataTypesConfig,
    FP16Config,
    TorchAutocastConfig,
)
from shardwise.precision.loss_scaler import LossScaler, build_loss_scaler

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class PrecisionPolicy:
    """How one run computes, accumulates and scales."""

    param_dtype: torch.dtype
    grad_accum_dtype: torch.dtype
    autocast_dtype: torch.dtype | None
    loss_scaler: LossScaler
    check_overflow: bool
    cast_inputs: bool
    buffer_dtype: torch.dtype | None = None
    """``data_types.buffer_dtype``: None keeps each buffer's own dtype (see precision.buffer_dtypes)."""
    keep_in_fp32_modules: str | list[str] = "auto"
    """``data_types.keep_in_fp32_modules``: buffers kept in fp32 in 16-bit runs."""

    @property
    def name(self) -> str:
        """``"fp32"``, ``"bf16"``, ``"fp16"`` or ``"autocast-<dtype>"``."""
        if self.autocast_dtype is not None:
            return f"autocast-{str(self.autocast_dtype).removeprefix('torch.')}"
        return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[self.param_dtype]

    @contextlib.contextmanager
    def forward_context(self, device_type: str) -> Iterator[None]:
        """Autocast for the forward when the policy asks for it."""
        if self.autocast_dtype is None:
            yield
        else:
            with torch.autocast(device_type=device_type, dtype=self.autocast_dtype):
                yield

    def cast_forward_inputs(
        self, args: tuple[object, ...], kwargs: dict[str, object]
    ) -> tuple[tuple[object, ...], dict[str, object]]:
        """``fp16.auto_cast``: floating-point inputs (nested) become the parameter dtype."""
        if not self.cast_inputs:
            return args, kwargs

        def cast(value: object) -> Any:
            if torch.is_tensor(value) and value.is_floating_point():
                return value.to(self.param_dtype)
            if isinstance(value, list | tuple):
                return type(value)(cast(v) for v in value)
            if isinstance(value, dict):
                return {k: cast(v) for k, v in value.items()}
            return value

        return cast(args), cast(kwargs)


def build_precision(
    fp16: FP16Config,
    bf16: BF16Config,
    *,
    amp: AmpConfig,
    torch_autocast: TorchAutocastConfig,
    data_types: DataTypesConfig,
) -> PrecisionPolicy:
    """The policy from the config's precision sections (``fp16``, ``bf16``, ``amp``,
    ``torch_autocast``, ``data_types``), validated.

    Example:
        >>> from shardwise.config import load_config
        >>> c = load_config({"train_batch_size": 8, "bf16": {"enabled": True}}).config
        >>> build_precision(
        ...     c.fp16, c.bf16, amp=c.amp, torch_autocast=c.torch_autocast, data_types=c.data_types
        ... ).param_dtype
        torch.bfloat16
    """
    scaler_args = dict(
        loss_scale=fp16.loss_scale,
        initial_scale_power=fp16.initial_scale_power,
        loss_scale_window=fp16.loss_scale_window,
        hysteresis=fp16.hysteresis,
        consecutive_hysteresis=fp16.consecutive_hysteresis,
        min_loss_scale=fp16.min_loss_scale,
    )
    autocast_dtype: torch.dtype | None = None
    if fp16.enabled:
        param_dtype = torch.float16
    elif bf16.enabled:
        param_dtype = torch.bfloat16
    else:
        param_dtype = torch.float32
        if amp.enabled:
            autocast_dtype = torch.float16
        elif torch_autocast.enabled:
            autocast_dtype = torch.float16 if torch_autocast.dtype == "float16" else torch.bfloat16
    # ShardwiseConfig.fp16_loss_scaling's rule, read off the dtypes chosen above
    fp16_math = param_dtype == torch.float16 or autocast_dtype == torch.float16
    scaler = build_loss_scaler(fp16_enabled=fp16_math, **scaler_args)  # type: ignore[arg-type]
    accum = data_types.grad_accum_dtype
    return PrecisionPolicy(
        param_dtype=param_dtype,
        grad_accum_dtype=DTYPES[accum] if accum else torch.float32,
        autocast_dtype=autocast_dtype,
        loss_scaler=scaler,
        check_overflow=fp16_math or (param_dtype == torch.bfloat16 and bf16.check_grad_overflow),
        cast_inputs=fp16.enabled and fp16.auto_cast,
        buffer_dtype=DTYPES[data_types.buffer_dtype] if data_types.buffer_dtype else None,
        keep_in_fp32_modules=data_types.keep_in_fp32_modules,
    )
