"""Precision: the fp16 loss scaler, overflow checks and the per-run precision policy."""

from shardwise.precision.loss_scaler import (
    DynamicLossScaler,
    LossScaleAtMinimumError,
    LossScaler,
    NoOpLossScaler,
    StaticLossScaler,
    build_loss_scaler,
)

__all__ = [
    "DynamicLossScaler",
    "LossScaleAtMinimumError",
    "LossScaler",
    "NoOpLossScaler",
    "StaticLossScaler",
    "build_loss_scaler",
]
