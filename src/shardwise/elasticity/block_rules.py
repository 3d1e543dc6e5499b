"""The ``elasticity`` block's rules: :class:`ElasticityConfig` (validated, with spec 10.1's defaults),
the batch keys elasticity overrides, and the elasticity errors."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "BATCH_KEYS",
    "ElasticityConfig",
    "ElasticityConfigError",
    "ElasticityError",
    "ElasticityIncompatibleWorldSize",
]


class ElasticityError(ValueError):
    """Base class of every elasticity error."""


class ElasticityConfigError(ElasticityError):
    """The ``elasticity`` block is missing, disabled or invalid."""


class ElasticityIncompatibleWorldSize(ElasticityError):
    """The world size cannot run the elastic batch size exactly."""


BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
"""Top-level batch keys that elasticity computes and therefore overrides."""

_DEFAULTS: dict[str, object] = {
    "enabled": False,
    "max_train_batch_size": 2000,
    "micro_batch_sizes": [2, 4, 6],
    "min_gpus": 1,
    "max_gpus": 10000,
    "num_gpus_per_node": 1,
    "model_parallel_size": 1,
    "min_time": 0,
    "prefer_larger_batch": True,
    "ignore_non_elastic_batch_info": False,
    "version": 0.2,
}
_SUPPORTED_VERSIONS = (0.1, 0.2)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class ElasticityConfig:
    """The validated ``elasticity`` block (spec 10.1 defaults)."""

    enabled: bool = False
    max_train_batch_size: int = 2000
    micro_batch_sizes: tuple[int, ...] = (2, 4, 6)
    min_gpus: int = 1
    max_gpus: int = 10000
    num_gpus_per_node: int = 1
    model_parallel_size: int = 1
    min_time: int = 0
    prefer_larger_batch: bool = True
    ignore_non_elastic_batch_info: bool = False
    version: float = 0.2

    @classmethod
    def from_dict(cls, block: Mapping[str, Any]) -> ElasticityConfig:
        """Validate an ``elasticity`` block and fill in defaults.

        Raises:
            ElasticityConfigError: unknown keys (with a did-you-mean), wrong types, values
                out of range, or a required key missing while ``enabled`` is true.

        Example:
            >>> ElasticityConfig.from_dict({"enabled": True, "max_train_batch_size": 64,
            ...                             "micro_batch_sizes": [2, 4]}).version
            0.2
        """
        if not isinstance(block, Mapping):
            raise ElasticityConfigError(
                f"elasticity must be a JSON object, got {type(block).__name__}: {block!r}."
            )
        for key in block:
            if key not in _DEFAULTS:
                close = difflib.get_close_matches(str(key), list(_DEFAULTS), n=1)
                hint = f" Did you mean '{close[0]}'?" if close else f" Known keys: {', '.join(_DEFAULTS)}."
                raise ElasticityConfigError(f"Unknown key elasticity.{key}.{hint}")
        values = {**_DEFAULTS, **block}

        for key in ("enabled", "prefer_larger_batch", "ignore_non_elastic_batch_info"):
            if not isinstance(values[key], bool):
                raise ElasticityConfigError(f"elasticity.{key} must be true or false, got {values[key]!r}.")
        if values["enabled"]:
            for key in ("max_train_batch_size", "micro_batch_sizes"):
                if key not in block:
                    raise ElasticityConfigError(
                        f"elasticity.{key} is required when elasticity is enabled (for example "
                        f'"{key}": {_DEFAULTS[key]!r}).'
                    )

        for key, minimum in (("max_train_batch_size", 1), ("min_gpus", 1), ("num_gpus_per_node", 1),
                             ("model_parallel_size", 1), ("min_time", 0)):  # fmt: skip
            if not _is_int(values[key]) or values[key] < minimum:
                raise ElasticityConfigError(
                    f"elasticity.{key} must be an integer >= {minimum}, got {values[key]!r}."
                )
        if not _is_int(values["max_gpus"]) or values["max_gpus"] < values["min_gpus"]:
            raise ElasticityConfigError(
                f"elasticity.max_gpus must be an integer >= min_gpus ({values['min_gpus']}), got {values['max_gpus']!r}."
            )
        micro = values["micro_batch_sizes"]
        if not isinstance(micro, list | tuple) or not micro or not all(_is_int(m) and m > 0 for m in micro):
            raise ElasticityConfigError(
                f"elasticity.micro_batch_sizes must be a non-empty list of positive integers, got {micro!r}."
            )
        if any(m > values["max_train_batch_size"] for m in micro):
            raise ElasticityConfigError(
                f"elasticity.micro_batch_sizes {list(micro)} has a value above max_train_batch_size "
                f"({values['max_train_batch_size']}); every micro batch must fit in the global batch."
            )
        version = values["version"]
        if (
            isinstance(version, bool)
            or not isinstance(version, int | float)
            or version not in _SUPPORTED_VERSIONS
        ):
            raise ElasticityConfigError(
                f"elasticity.version must be one of {list(_SUPPORTED_VERSIONS)}, got {version!r}."
            )
        if values["model_parallel_size"] > 1 and version < 0.2:
            raise ElasticityConfigError(
                f"elasticity.model_parallel_size={values['model_parallel_size']} needs version 0.2; "
                "version 0.1 only supports pure data parallelism."
            )
        if values["num_gpus_per_node"] % values["model_parallel_size"] != 0:
            raise ElasticityConfigError(
                f"elasticity.num_gpus_per_node ({values['num_gpus_per_node']}) must be a multiple of "
                f"model_parallel_size ({values['model_parallel_size']})."
            )
        return cls(**{**values, "micro_batch_sizes": tuple(micro), "version": float(version)})
