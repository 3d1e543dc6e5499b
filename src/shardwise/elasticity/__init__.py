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

import json
import os
from collections.abc import Mapping
from typing import Any, Literal, overload

from shardwise.elasticity.batch_search import HCN_LIST, get_compatible_gpus_v01, get_compatible_gpus_v02
from shardwise.elasticity.block_rules import (
    _DEFAULTS,
    BATCH_KEYS,
    ElasticityConfig,
    ElasticityConfigError,
    ElasticityError,
    ElasticityIncompatibleWorldSize,
    _is_int,
)
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
