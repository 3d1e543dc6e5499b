"""``deepspeed.tp_model_init(model, tp_size, dtype)``: recorded now, applied by ``initialize``.

As in DeepSpeed (0.16.4+), the call does not split the model itself: it records the degree, the
dtype and an optional ``tp_group``; ``initialize`` merges them into the config's
``tensor_parallel`` section (filling what the config leaves out; a different value there is an
error) and splits the model when it builds the engine. Two calls must agree.

Example:
    >>> import torch
    >>> reset_recorded()
    >>> _ = tp_model_init(torch.nn.Linear(2, 2), tp_size=2, dtype=torch.float32)
    >>> merged = merge_into_config({"train_micro_batch_size_per_gpu": 1}, mpu=None)
    >>> merged["tensor_parallel"]["autotp_size"]
    2
    >>> reset_recorded()
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "RecordedInit",
    "is_autotp_training_mode",
    "merge_into_config",
    "recorded",
    "reset_recorded",
    "set_autotp_mode",
    "tp_model_init",
]


@dataclass(frozen=True)
class RecordedInit:
    """What ``tp_model_init`` was called with."""

    tp_size: int
    dtype: torch.dtype
    tp_group: object = None


_RECORDED: list[RecordedInit] = []
_TRAINING: list[bool] = [False]


def set_autotp_mode(training: bool = False) -> None:
    """DeepSpeed's AutoTP mode flag: training (True) or inference (False)."""
    _TRAINING[0] = bool(training)


def is_autotp_training_mode() -> bool:
    """Whether AutoTP is in training mode (``tp_model_init`` or ``set_autotp_mode(training=True)``)."""
    return _TRAINING[0]
_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def recorded() -> RecordedInit | None:
    """The recorded ``tp_model_init`` arguments, or None."""
    return _RECORDED[0] if _RECORDED else None


def reset_recorded() -> None:
    """Forget the recorded arguments (tests; a new model in the same process)."""
    _RECORDED.clear()


def tp_model_init(model: nn.Module, tp_size: int, dtype: torch.dtype, config: object = None,
                  **kwargs: Any) -> nn.Module:
    """Record the tensor-parallel degree and dtype for the next ``initialize``; return ``model`` unchanged.

    Args:
        model: the model ``initialize`` will split.
        tp_size: the tensor-parallel degree (``tensor_parallel.autotp_size``).
        dtype: the training dtype; it must agree with the config's fp16/bf16 section.
        config: accepted for DeepSpeed's signature; the config that counts is ``initialize``'s.
        kwargs: ``tp_group``: a tensor-parallel group of ``tp_size`` ranks (then ``initialize``
            must not also get an ``mpu``).

    Raises:
        ValueError: an invalid degree, an unknown keyword, or a second call with other values.
    """
    unknown = sorted(set(kwargs) - {"tp_group"})
    if unknown:
        raise ValueError(f"tp_model_init({unknown[0]}=...): not an argument; pass tp_size, dtype and optionally tp_group")
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_model_init(tp_size={tp_size!r}): it must be an int >= 1")
    new = RecordedInit(tp_size=tp_size, dtype=dtype, tp_group=kwargs.get("tp_group"))
    old = recorded()
    if old is not None and (old.tp_size, old.dtype, old.tp_group is None) != (new.tp_size, new.dtype, new.tp_group is None):
        raise ValueError(
            f"Conflicting tp_model_init arguments detected across multiple calls: first tp_size={old.tp_size}, "
            f"dtype={old.dtype}, then tp_size={new.tp_size}, dtype={new.dtype}; call it once per model"
        )
    _RECORDED[:] = [new]
    set_autotp_mode(training=True)
    return model


def _config_dtype(config: dict[str, Any]) -> torch.dtype | None:
    for key, dtype in (("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16), ("fp16", torch.float16)):
        section = config.get(key)
        if isinstance(section, dict) and section.get("enabled", False) is True:
            return dtype
    return None


def merge_into_config(config: dict[str, Any], mpu: object) -> dict[str, Any]:
    """``config`` with the recorded ``tp_model_init`` arguments merged into ``tensor_parallel``
    (a new dict; ``config`` itself is unchanged). Without a recording, ``config`` as it is.

    Raises:
        ValueError: the config or the ``mpu`` disagrees with the recorded arguments (the message
            names ``tensor_parallel.autotp_size``, the ``tp_group``/mpu clash or the dtype).
    """
    init = recorded()
    if init is None:
        return config
    if init.tp_group is not None and mpu is not None:
        raise ValueError("tp_model_init provided tp_group; deepspeed.initialize must not receive mpu. Pass one of them")
    merged = dict(config)
    section = dict(merged.get("tensor_parallel") or {})
    size = section.get("autotp_size")
    if size is not None and size != init.tp_size:
        raise ValueError(
            f"Conflicting tensor_parallel.autotp_size in config ({size}) and tp_model_init ({init.tp_size}): "
            "give one degree, or drop tensor_parallel.autotp_size and let tp_model_init set it"
        )
    section["autotp_size"] = init.tp_size
    tp = dict(section.get("tp") or {})
    if tp.get("tp_size") not in (None, init.tp_size):
        raise ValueError(f"Conflicting tensor_parallel.tp.tp_size in config ({tp['tp_size']}) and tp_model_init "
                         f"({init.tp_size})")
    tp["tp_size"] = init.tp_size
    section["tp"] = tp
    dtype = _config_dtype(merged)
    if dtype is not None and dtype != init.dtype:
        raise ValueError(f"Conflicting dtype: config uses {dtype} but tp_model_init requested {init.dtype}; "
                         "make the fp16/bf16 section and tp_model_init's dtype agree")
    named = section.get("dtype")
    named = _DTYPES.get(named.lower()) if isinstance(named, str) else named
    if named is not None and named != init.dtype:
        raise ValueError(f"Conflicting tensor_parallel.dtype in config ({section['dtype']}) and tp_model_init "
                         f"({init.dtype})")
    merged["tensor_parallel"] = section
    return merged
