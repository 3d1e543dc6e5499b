"""The fp16 loss scaler's settings rules, in one place.

The dynamic scaler (:class:`shardwise.precision.DynamicLossScaler`) validates its settings with
:func:`dynamic_scale_settings` when ``initialize`` builds it, and ``load_config`` runs the same
function when the run scales its loss dynamically (``shardwise.config.checks``), so ``config
check`` and ``initialize`` agree. Pure Python: no torch.
"""

from __future__ import annotations

import math
import operator
from typing import Any

from shardwise.config.errors import ConfigError


def format_scale(value: float) -> str:
    """Show a scale the way people read it: ``65536`` rather than ``65536.0``."""
    if math.isfinite(value) and value == int(value) and abs(value) < 1e16:
        return str(int(value))
    return repr(value)


def as_int(key: str, value: Any, minimum: int | None = None, maximum: int | None = None) -> int:
    """Validate an integer setting (bools are rejected: ``True`` is not a window size)."""
    if isinstance(value, bool):
        raise ConfigError(key, "must be an integer, not a bool", "write a whole number", value)
    try:
        result = operator.index(value)
    except TypeError:
        raise ConfigError(key, "must be an integer", "write a whole number", value) from None
    if minimum is not None and result < minimum:
        raise ConfigError(key, f"must be >= {minimum}", f"use a value of at least {minimum}", value)
    if maximum is not None and result > maximum:
        raise ConfigError(key, f"must be <= {maximum}", f"use a value of at most {maximum}", value)
    return result


def as_positive_float(key: str, value: object) -> float:
    """Validate a finite, strictly positive number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(key, "must be a number", "write a positive number such as 1", value)
    result = float(value)
    if not math.isfinite(result) or result <= 0:
        raise ConfigError(key, "must be finite and > 0", "write a positive number such as 1", value)
    return result


def dynamic_scale_settings(
    initial_scale_power: object,
    loss_scale_window: object,
    hysteresis: object,
    consecutive_hysteresis: object,
    min_loss_scale: object,
) -> tuple[int, int, int, bool, float]:
    """The dynamic scaler's settings, validated: ``(power, window, hysteresis, consecutive, minimum)``.

    Raises:
        ConfigError: naming the ``fp16.*`` key that is out of range.

    Example:
        >>> dynamic_scale_settings(16, 1000, 2, False, 1)
        (16, 1000, 2, False, 1.0)
    """
    # 2**p must be a normal float32 so the scaled fp32 loss can represent it.
    power = as_int("fp16.initial_scale_power", initial_scale_power, -126, 127)
    window = as_int("fp16.loss_scale_window", loss_scale_window, minimum=1)
    # hysteresis 0 would never lower the scale (the budget would count down past 1 forever).
    budget = as_int("fp16.hysteresis", hysteresis, minimum=1)
    if not isinstance(consecutive_hysteresis, bool):
        raise ConfigError(
            "fp16.consecutive_hysteresis",
            "must be true or false",
            "write true or false",
            consecutive_hysteresis,
        )
    minimum = as_positive_float("fp16.min_loss_scale", min_loss_scale)
    initial = 2.0**power
    if initial < minimum:
        raise ConfigError(
            "fp16.initial_scale_power",
            f"gives an initial loss scale 2**{power} = {format_scale(initial)}, below "
            f"'fp16.min_loss_scale' = {format_scale(minimum)}",
            "raise 'fp16.initial_scale_power' (16 is the usual value) or lower 'fp16.min_loss_scale'",
            power,
        )
    return power, window, budget, consecutive_hysteresis, minimum
