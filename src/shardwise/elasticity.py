"""Elastic batch sizing: one global batch size that works for many GPU counts.

DeepSpeed (up to 0.19.6) let a config declare an ``elasticity`` block instead of fixed batch
keys: a ceiling on the global batch, a list of acceptable micro batches and a GPU range. The
algorithm picks the batch size (below the ceiling) that the largest number of GPU counts can
run exactly, so a job can be rescheduled on a different number of GPUs with the same
convergence behaviour. This module reproduces that behaviour (spec section 10) as pure
functions: no torch, no processes.

* v0.1 (:func:`get_compatible_gpus_v01`): candidate batches are ``H * base`` with ``H`` the
  largest highly composite number that fits, for each micro batch and their LCM; the winner
  has the most valid GPU counts.
* v0.2 (:func:`get_compatible_gpus_v02`): v0.1 at node granularity, scaled by the data-parallel
  ranks per node; when the current world size is not among the results, the batch is fitted
  to that world size instead.

Model parallelism (v0.2 only) is where DeepSpeed mixes GPU counts and data-parallel sizes; we
consistently use the data-parallel size ``world_size // model_parallel_size`` for the validity
check and the micro-batch choice. With ``model_parallel_size == 1`` (the only case the spec
measured) the results are identical.
"""

from __future__ import annotations

import bisect
import difflib
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, overload

from shardwise.utils.logging import logger

__all__ = [
    "BATCH_KEYS",
    "HCN_LIST",
    "ElasticityConfig",
    "ElasticityConfigError",
    "ElasticityError",
    "ElasticityIncompatibleWorldSize",
    "check_scheduler_elastic_config",
    "compute_elastic_config",
    "elastic_batch_for_world_size",
    "get_compatible_gpus_v01",
    "get_compatible_gpus_v02",
    "reject_explicit_batch_keys",
]


class ElasticityError(ValueError):
    """Base class of every elasticity error."""


class ElasticityConfigError(ElasticityError):
    """The ``elasticity`` block is missing, disabled or invalid."""


class ElasticityIncompatibleWorldSize(ElasticityError):
    """The world size cannot run the elastic batch size exactly."""


# The 38 smallest highly composite numbers: each has more divisors than any smaller number,
# which is what makes them good multipliers for a batch that many GPU counts must divide.
HCN_LIST: tuple[int, ...] = (
    1, 2, 4, 6, 12, 24, 36, 48, 60, 120, 180, 240, 360, 720, 840, 1260, 1680, 2520, 5040, 7560, 10080,
    15120, 20160, 25200, 27720, 45360, 50400, 55440, 83160, 110880, 166320, 221760, 277200, 332640,
    498960, 554400, 665280, 720720,
)  # fmt: skip

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


def _divisors(n: int) -> list[int]:
    small = [i for i in range(1, math.isqrt(n) + 1) if n % i == 0]
    return small + [n // i for i in reversed(small) if i * i != n]


def _valid_gpus(batch: int, micro_batches: list[int], min_gpus: int, max_gpus: int) -> list[int]:
    """GPU counts that run ``batch`` exactly with some micro batch (spec 10.2 step 3)."""
    valid: set[int] = set()
    for micro in micro_batches:
        if batch % micro:
            continue
        gpus = batch // micro
        if min_gpus <= gpus <= max_gpus:
            valid.add(gpus)
        # Proper divisors up to gpus // 2: these GPU counts run the batch with more accumulation steps.
        valid.update(i for i in _divisors(gpus) if i <= gpus // 2 and min_gpus <= i <= max_gpus)
    return sorted(valid)


def _best_batch(
    micro_batches: list[int], max_batch: int, min_gpus: int, max_gpus: int, prefer_larger: bool
) -> tuple[int, list[int]]:
    """v0.1 steps 1-4 without the empty-result check; the result's GPU list may be empty."""
    bases = [*micro_batches, math.lcm(*micro_batches)]
    candidates: list[int] = []
    for base in bases:
        if base > max_batch:
            continue
        # Largest highly composite number H with H * base <= max_batch.
        candidate = (
            base
            if base == max_batch
            else HCN_LIST[bisect.bisect_right(HCN_LIST, max_batch // base) - 1] * base
        )
        if candidate not in candidates:
            candidates.append(candidate)

    final, best = min(micro_batches), list[int]()
    for batch in candidates:
        valid = _valid_gpus(batch, micro_batches, min_gpus, max_gpus)
        tie_wins = batch > final if prefer_larger else batch < final
        if len(valid) > len(best) or (len(valid) == len(best) and tie_wins):
            final, best = batch, valid
    return final, best


def get_compatible_gpus_v01(
    micro_batches: list[int],
    max_batch: int,
    min_gpus: int | None = None,
    max_gpus: int | None = None,
    prefer_larger: bool = True,
) -> tuple[int, list[int]]:
    """Elasticity v0.1: the batch size <= ``max_batch`` that the most GPU counts can run.

    Args:
        micro_batches: acceptable per-GPU micro batch sizes.
        max_batch: ceiling on the global batch size.
        min_gpus: smallest GPU count to consider (default 1).
        max_gpus: largest GPU count to consider (default ``max_batch // min(micro_batches)``).
        prefer_larger: on a tie in the number of valid GPU counts, take the larger batch.

    Returns:
        ``(final_batch_size, sorted valid GPU counts)``.

    Raises:
        ElasticityConfigError: a micro batch exceeds ``max_batch``, or no GPU count in
            ``[min_gpus, max_gpus]`` fits any candidate.

    Example:
        >>> batch, gpus = get_compatible_gpus_v01([2, 4, 6], 2000)
        >>> batch, len(gpus), gpus[-1]
        (1680, 32, 840)
    """
    micro_batches = list(micro_batches)
    if not micro_batches or any(not _is_int(m) or m <= 0 for m in micro_batches):
        raise ElasticityConfigError(f"micro batches must be positive integers, got {micro_batches!r}.")
    if any(m > max_batch for m in micro_batches):
        raise ElasticityConfigError(
            f"All micro batches must be <= max_train_batch_size ({max_batch}), got {micro_batches}."
        )
    min_gpus = 1 if min_gpus is None else min_gpus
    max_gpus = max_batch // min(micro_batches) if max_gpus is None else max_gpus
    final, valid = _best_batch(micro_batches, max_batch, min_gpus, max_gpus, prefer_larger)
    if not valid:
        raise ElasticityConfigError(
            f"No GPU count in [{min_gpus}, {max_gpus}] can run any batch size <= {max_batch} with micro "
            f"batches {micro_batches}; widen min_gpus/max_gpus or raise max_train_batch_size."
        )
    return final, valid


def _pick_micro_batch(micro_batches: list[int], per_rank_batch: int, prefer_larger: bool) -> int | None:
    """First micro batch (list order) dividing ``per_rank_batch``, or the largest such when preferred."""
    fitting = [m for m in micro_batches if per_rank_batch % m == 0]
    if not fitting:
        return None
    return max(fitting) if prefer_larger else fitting[0]


def get_compatible_gpus_v02(
    micro_batches: list[int],
    max_batch: int,
    current_num_gpus: int,
    min_gpus: int,
    max_gpus: int,
    prefer_larger: bool = True,
    num_gpus_per_node: int = 1,
    model_parallel_size: int = 1,
) -> tuple[int, list[int], int | None]:
    """Elasticity v0.2: v0.1 at node granularity, or a batch fitted to the current world size.

    Returns:
        ``(final_batch_size, valid data-parallel sizes, micro batch for current_num_gpus)``.

    Raises:
        ElasticityConfigError: ``num_gpus_per_node`` is not a multiple of
            ``model_parallel_size``, or the node-level problem has no solution.
        ElasticityIncompatibleWorldSize: ``current_num_gpus`` is not a multiple of
            ``model_parallel_size``, or is too large for even one smallest micro batch each.

    Example:
        >>> get_compatible_gpus_v02([8, 12], 1000, 64, 32, 1500, num_gpus_per_node=8)
        (768, [32, 48, 64, 96], 12)
    """
    micro_batches = list(micro_batches)
    if num_gpus_per_node % model_parallel_size != 0:
        raise ElasticityConfigError(
            f"num_gpus_per_node ({num_gpus_per_node}) must be a multiple of model_parallel_size ({model_parallel_size})."
        )
    if current_num_gpus <= 0 or current_num_gpus % model_parallel_size != 0:
        raise ElasticityIncompatibleWorldSize(
            f"World size {current_num_gpus} must be a positive multiple of model_parallel_size ({model_parallel_size})."
        )
    dp_per_node = num_gpus_per_node // model_parallel_size
    current_dp = current_num_gpus // model_parallel_size

    node_max_batch = max_batch // dp_per_node
    if any(m > node_max_batch for m in micro_batches):
        raise ElasticityConfigError(
            f"max_train_batch_size {max_batch} spread over {dp_per_node} data-parallel ranks per node leaves "
            f"{node_max_batch} per node, below a micro batch in {micro_batches}; raise max_train_batch_size."
        )
    node_batch, node_counts = _best_batch(
        micro_batches,
        node_max_batch,
        min_gpus // num_gpus_per_node,
        max_gpus // num_gpus_per_node,
        prefer_larger,
    )
    if not node_counts:
        raise ElasticityConfigError(
            f"No node count in [{min_gpus // num_gpus_per_node}, {max_gpus // num_gpus_per_node}] "
            f"(min_gpus/max_gpus divided by num_gpus_per_node={num_gpus_per_node}) fits micro batches "
            f"{micro_batches}; widen min_gpus/max_gpus."
        )
    final = node_batch * dp_per_node
    valid_dp = [n * dp_per_node for n in node_counts]
    if current_dp in valid_dp:
        return final, valid_dp, _pick_micro_batch(micro_batches, final // current_dp, prefer_larger)

    # The current world size is not among the elastic ones: fit the batch to it instead.
    candidates = [(max_batch // (m * current_dp)) * m * current_dp for m in micro_batches]
    final = max(candidates) if prefer_larger else min(candidates)
    if final == 0:
        raise ElasticityIncompatibleWorldSize(
            f"World size {current_num_gpus} (data-parallel size {current_dp}) is too large: even micro batch "
            f"{min(micro_batches)} per rank exceeds max_train_batch_size {max_batch}."
        )
    return final, [current_dp], _pick_micro_batch(micro_batches, final // current_dp, prefer_larger)


def _elasticity_block(ds_config: object) -> ElasticityConfig:
    if not isinstance(ds_config, Mapping):
        raise ElasticityConfigError(f"ds_config must be a dict, got {type(ds_config).__name__}.")
    if "elasticity" not in ds_config:
        raise ElasticityConfigError("ds_config has no 'elasticity' block; add one with \"enabled\": true.")
    config = ElasticityConfig.from_dict(ds_config["elasticity"])
    if not config.enabled:
        raise ElasticityConfigError(
            'elasticity is disabled; set "elasticity": {"enabled": true, ...} to use it.'
        )
    return config


@overload
def compute_elastic_config(
    ds_config: Mapping[str, object],
    world_size: int = 0,
    return_microbatch: Literal[False] = False,
    *,
    target_deepspeed_version: str | None = None,
) -> tuple[int, list[int]]: ...
@overload
def compute_elastic_config(
    ds_config: Mapping[str, object],
    world_size: int = 0,
    *,
    return_microbatch: Literal[True],
    target_deepspeed_version: str | None = None,
) -> tuple[int, list[int], int]: ...
@overload
def compute_elastic_config(
    ds_config: Mapping[str, object],
    world_size: int = 0,
    return_microbatch: bool = False,
    *,
    target_deepspeed_version: str | None = None,
) -> tuple[int, list[int]] | tuple[int, list[int], int]: ...
def compute_elastic_config(
    ds_config: Mapping[str, object],
    world_size: int = 0,
    return_microbatch: bool = False,
    *,
    target_deepspeed_version: str | None = None,
) -> tuple[int, list[int]] | tuple[int, list[int], int]:
    """Compute the elastic batch size and the GPU counts (v0.2: data-parallel sizes) it supports.

    Args:
        ds_config: the whole config dict; its ``elasticity`` block must be enabled.
        world_size: the current number of GPUs, or 0 if unknown. v0.2 needs it and falls
            back to the ``WORLD_SIZE`` environment variable.
        return_microbatch: also return the micro batch for ``world_size``.
        target_deepspeed_version: accepted for familiarity with DeepSpeed's signature and
            ignored.

    Returns:
        ``(final_batch_size, valid_gpus)`` or ``(final_batch_size, valid_gpus, micro_batch)``.

    Raises:
        ElasticityConfigError: missing, disabled or invalid block; or a missing world
            size where one is needed.
        ElasticityIncompatibleWorldSize: ``world_size`` is not among the valid sizes.

    Example:
        >>> cfg = {"elasticity": {"enabled": True, "max_train_batch_size": 2000,
        ...                       "micro_batch_sizes": [2, 4, 6], "version": 0.1}}
        >>> compute_elastic_config(cfg, world_size=8, return_microbatch=True)[::2]
        (1680, 6)
    """
    del target_deepspeed_version  # DeepSpeed checks it against 0.3.8; every shardwise release qualifies.
    config = _elasticity_block(ds_config)
    if isinstance(world_size, bool) or not _is_int(world_size) or world_size < 0:
        raise ElasticityConfigError(f"world_size must be a non-negative integer, got {world_size!r}.")
    micro = list(config.micro_batch_sizes)

    if config.version >= 0.2:
        if world_size == 0:
            env_value = os.environ.get("WORLD_SIZE", "")
            if not env_value.strip().isdigit() or int(env_value) == 0:
                raise ElasticityConfigError(
                    "Elasticity v0.2 needs the world size: pass world_size=... or set the WORLD_SIZE "
                    f"environment variable (currently {env_value!r})."
                )
            world_size = int(env_value)
        final, valid, _ = get_compatible_gpus_v02(
            micro, config.max_train_batch_size, world_size, config.min_gpus, config.max_gpus,
            config.prefer_larger_batch, config.num_gpus_per_node, config.model_parallel_size,
        )  # fmt: skip
    else:
        final, valid = get_compatible_gpus_v01(
            micro, config.max_train_batch_size, config.min_gpus, config.max_gpus, config.prefer_larger_batch
        )

    micro_batch: int | None = None
    if world_size > 0:
        dp_size = world_size // config.model_parallel_size
        if world_size % config.model_parallel_size or dp_size not in valid:
            raise ElasticityIncompatibleWorldSize(
                f"World size {world_size} is not compatible with the elastic batch size {final}; "
                f"valid {'data-parallel sizes' if config.version >= 0.2 else 'GPU counts'} are {valid}."
            )
        micro_batch = max(m for m in micro if (final // dp_size) % m == 0)
    if not return_microbatch:
        return final, valid
    if micro_batch is None:
        raise ElasticityConfigError("return_microbatch=True needs world_size > 0 to choose a micro batch.")
    return final, valid, micro_batch


def elastic_batch_for_world_size(ds_config: Mapping[str, Any], world_size: int) -> tuple[int, int, int]:
    """The ``(train_batch_size, micro_batch, gradient_accumulation_steps)`` elasticity sets.

    ``GAS = TBS // (MBS * data-parallel size)``; with ``model_parallel_size == 1`` the
    data-parallel size is the world size (spec 10.5 step 4).

    Example:
        >>> cfg = {"elasticity": {"enabled": True, "max_train_batch_size": 2000,
        ...                       "micro_batch_sizes": [2, 4, 6], "version": 0.1}}
        >>> elastic_batch_for_world_size(cfg, 8)
        (1680, 6, 35)
    """
    if isinstance(world_size, bool) or not _is_int(world_size) or world_size <= 0:
        raise ElasticityConfigError(f"world_size must be a positive integer, got {world_size!r}.")
    final, _, micro = compute_elastic_config(ds_config, world_size=world_size, return_microbatch=True)
    dp_size = world_size // ElasticityConfig.from_dict(ds_config["elasticity"]).model_parallel_size
    return final, micro, final // (micro * dp_size)


def reject_explicit_batch_keys(ds_config: Mapping[str, object]) -> None:
    """Raise when the config sets batch keys that elasticity would silently override (spec 10.5 step 3).

    Raises:
        ElasticityConfigError: a key of :data:`BATCH_KEYS` is present and
            ``elasticity.ignore_non_elastic_batch_info`` is false.

    Example:
        >>> reject_explicit_batch_keys({"elasticity": {"enabled": True, "max_train_batch_size": 8,
        ...     "micro_batch_sizes": [2], "ignore_non_elastic_batch_info": True}, "train_batch_size": 8})
    """
    config = _elasticity_block(ds_config)
    present = [key for key in BATCH_KEYS if key in ds_config]
    if present and not config.ignore_non_elastic_batch_info:
        raise ElasticityConfigError(
            f"One or more batch related parameters were found in your ds_config ({', '.join(present)}) while "
            "elasticity is enabled; elasticity computes them. Remove them, or set "
            '"elasticity": {"ignore_non_elastic_batch_info": true} to let elasticity override them.'
        )


def check_scheduler_elastic_config(
    ds_config: Mapping[str, object], scheduler_config: str | Mapping[str, object] | None
) -> None:
    """Check the scheduler's elasticity settings against the runtime config (spec 10.5 step 2).

    The scheduler that sized the job passes its view of the ``elasticity`` block as JSON in
    ``DEEPSPEED_ELASTICITY_CONFIG``; if its batch ceiling, micro batches or version differ
    from the runtime config, the two would pick different batch sizes.

    Args:
        ds_config: the whole config dict with an enabled ``elasticity`` block.
        scheduler_config: the variable's JSON text (or the parsed dict), or ``None`` when
            it is not set, which only logs a warning.

    Raises:
        ElasticityConfigError: the JSON is invalid or a compared value differs.

    Example:
        >>> cfg = {"elasticity": {"enabled": True, "max_train_batch_size": 8, "micro_batch_sizes": [2]}}
        >>> check_scheduler_elastic_config(cfg, '{"max_train_batch_size": 8, "micro_batch_sizes": [2]}')
    """
    config = _elasticity_block(ds_config)
    if scheduler_config is None:
        logger.warning(
            "DEEPSPEED_ELASTICITY_CONFIG is not set: cannot check that the scheduler used the same elasticity "
            "settings as this config."
        )
        return
    if isinstance(scheduler_config, str):
        try:
            scheduler_config = json.loads(scheduler_config)
        except ValueError as exc:
            raise ElasticityConfigError(f"DEEPSPEED_ELASTICITY_CONFIG is not valid JSON: {exc}.") from exc
    if not isinstance(scheduler_config, Mapping):
        raise ElasticityConfigError(
            f"DEEPSPEED_ELASTICITY_CONFIG must be a JSON object, got {scheduler_config!r}."
        )
    runtime = {
        "max_train_batch_size": config.max_train_batch_size,
        "micro_batch_sizes": list(config.micro_batch_sizes),
        "version": config.version,
    }
    for key, mine in runtime.items():
        theirs = scheduler_config.get(key, _DEFAULTS[key])
        if isinstance(theirs, tuple):
            theirs = list(theirs)
        if theirs != mine:
            raise ElasticityConfigError(
                f"Environment elasticity config {key}={theirs!r} does not match the runtime config "
                f"elasticity.{key}={mine!r}; the scheduler and the job must use the same elasticity settings."
            )
