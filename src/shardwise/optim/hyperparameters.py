"""Range checks for the hyperparameters most optimizers share, before any constructor runs.

torch checks some of these itself, but with messages that name no config key (``Invalid
learning rate: -1``, or a ``TypeError`` from ``'<=' not supported`` for ``"lr": "fast"``),
and DeepSpeed's fused optimizers check none. These rules name ``optimizer.params.<key>``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from shardwise.config.errors import KeyedValueError

# key -> (rule, example) for scalars that must be finite numbers >= 0
_NON_NEGATIVE = {
    "lr": "a learning rate such as 1e-4",
    "eps": "a small positive number such as 1e-8",
    "weight_decay": "0 or a small number such as 0.01",
    "momentum": "a momentum such as 0.9, or 0",
}


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_hyperparameters(type_name: str, params: Mapping[str, Any]) -> None:
    """Raise a :class:`KeyedValueError` for ``lr``, ``eps``, ``weight_decay``, ``momentum`` or
    ``betas`` out of range (other keys are left to the optimizer's constructor).

    Example:
        >>> check_hyperparameters("AdamW", {"lr": 1e-3, "betas": [0.9, 0.999]})
        >>> check_hyperparameters("AdamW", {"lr": -1})
        Traceback (most recent call last):
        ...
        shardwise.config.errors.KeyedValueError: optimizer "AdamW": optimizer.params.lr must be a finite number >= 0. Fix: use a learning rate such as 1e-4.
    """
    for key, example in _NON_NEGATIVE.items():
        if key not in params:
            continue
        value = params[key]
        if not (_is_number(value) and math.isfinite(value) and value >= 0):
            raise KeyedValueError(
                f'optimizer "{type_name}": optimizer.params.{key} must be a finite number >= 0. '
                f"Fix: use {example}.",
                f"optimizer.params.{key}",
                value,
            )
    if "betas" in params:
        betas = params["betas"]
        ok = (
            isinstance(betas, list | tuple)
            and len(betas) == 2
            and all(_is_number(b) and 0 <= b < 1 for b in betas)
        )
        if not ok:
            raise KeyedValueError(
                f'optimizer "{type_name}": optimizer.params.betas must be two numbers in [0, 1). '
                "Fix: use [0.9, 0.999].",
                "optimizer.params.betas",
                betas,
            )
