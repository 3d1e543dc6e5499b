"""What ``configure`` decided: the six keys of ``activation_checkpointing`` plus the model-parallel
group of the ``mpu``, held once per process like DeepSpeed's module globals (spec 3.12, 6.6).

``configure`` reads the config section (a file, a dict, or an already validated config), lets
explicit arguments override it, and checks the combinations DeepSpeed asserts on, as
:class:`~shardwise.config.errors.ConfigError` naming the key, the value, the rule and a fix.

Example:
    >>> settings = configure(None, partition_activations=True)
    >>> settings.partition_activations, settings.mp_size, is_configured()
    (True, 1, True)
    >>> _ = configure(None)  # back to the defaults
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from pydantic import BaseModel, ValidationError

from shardwise.comm.group_type import Group
from shardwise.config.errors import AssertedConfigError, ConfigError
from shardwise.config.sections.features import ActivationCheckpointingConfig

__all__ = ["CheckpointingSettings", "configure", "current_settings", "describe", "is_configured"]

_SECTION = "activation_checkpointing"


@dataclass(frozen=True)
class CheckpointingSettings:
    """The active activation-checkpointing settings.

    Attributes:
        partition_activations: split each saved activation across the model-parallel group.
        cpu_checkpointing: keep saved activations in host memory.
        contiguous_memory_optimization: store them in one preallocated buffer.
        number_checkpoints: checkpoints per forward (the buffer's slot count).
        synchronize_checkpoint_boundary: synchronize the device at each checkpoint boundary.
        profile: time the forwards and recomputes (``shardwise.checkpointing.profile_times()``).
        mpu: the model-parallel unit given to ``configure`` (or None).
        mp_group: its model-parallel process group (None: no model parallelism).
        mp_rank: this rank in that group.
        mp_size: the group's size.
    """

    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: int | None = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False
    mpu: object = None
    mp_group: Group = None
    mp_rank: int = 0
    mp_size: int = 1

    @property
    def transforms_storage(self) -> bool:
        """True when saved activations are stored other than as they are."""
        return self.partition_activations or self.cpu_checkpointing or self.contiguous_memory_optimization


_current = CheckpointingSettings()
_configured = False


def current_settings() -> CheckpointingSettings:
    """The settings ``checkpoint`` uses now (the defaults until ``configure`` runs)."""
    return _current


def is_configured() -> bool:
    """True once :func:`configure` ran (DeepSpeed's ``is_configured``)."""
    return _configured


def _section(deepspeed_config: object) -> ActivationCheckpointingConfig:
    """The ``activation_checkpointing`` section of a path, dict, JSON text or validated config."""
    if deepspeed_config is None:
        return ActivationCheckpointingConfig()
    if isinstance(deepspeed_config, ActivationCheckpointingConfig):
        return deepspeed_config
    for holder in (deepspeed_config, getattr(deepspeed_config, "config", None)):  # ShardwiseConfig, Resolved
        section = getattr(holder, _SECTION, None)
        if isinstance(section, ActivationCheckpointingConfig):
            return section
    if isinstance(deepspeed_config, BaseModel):
        raise TypeError(f"configure(deepspeed_config=...) got a {type(deepspeed_config).__name__}")
    if not isinstance(deepspeed_config, str | os.PathLike | Mapping):
        raise TypeError(
            "configure(deepspeed_config=...) takes a ds_config path, a dict or a loaded config, "
            f"not {type(deepspeed_config).__name__}"
        )
    from shardwise.config.compat import normalize_legacy
    from shardwise.config.loading import read_config_source

    raw, _origin = read_config_source(deepspeed_config)
    normalize_legacy(raw)  # partitioned_activations -> partition_activations
    body = raw.get(_SECTION) or {}
    try:
        return ActivationCheckpointingConfig.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        key = ".".join([_SECTION, *(str(p) for p in first["loc"])])
        raise ConfigError(
            key, first["msg"], "see the activation_checkpointing keys in the README", value=first.get("input")
        ) from exc


def model_parallel_of(mpu: Any) -> tuple[Any, int, int]:
    """(group, rank, size) of the mpu's tensor/model-parallel group; (None, 0, 1) without an mpu."""
    if mpu is None:
        return None, 0, 1
    if hasattr(mpu, "get_tensor_model_parallel_rank"):
        return (
            mpu.get_tensor_model_parallel_group(),
            int(mpu.get_tensor_model_parallel_rank()),
            int(mpu.get_tensor_model_parallel_world_size()),
        )
    return (
        mpu.get_model_parallel_group(),
        int(mpu.get_model_parallel_rank()),
        int(mpu.get_model_parallel_world_size()),
    )


def _check_partitioning(settings: CheckpointingSettings) -> None:
    if settings.contiguous_memory_optimization and not settings.partition_activations:
        raise AssertedConfigError(
            f"{_SECTION}.contiguous_memory_optimization",
            "the contiguous buffer holds partitioned activations, so it needs partition_activations (as in DeepSpeed)",
            f"set {_SECTION}.partition_activations to true, or contiguous_memory_optimization to false",
            value=True,
        )


def missing_slot_count(settings: CheckpointingSettings) -> AssertedConfigError | None:
    """The error for contiguous memory with no usable slot count (None when there is one, or
    no contiguous buffer): the count comes from ``number_checkpoints`` or from ``configure``'s
    ``num_checkpoints`` (or ``set_num_layers``), as in DeepSpeed."""
    n = settings.number_checkpoints
    if not settings.contiguous_memory_optimization or (n is not None and n >= 1):
        return None
    return AssertedConfigError(
        f"{_SECTION}.number_checkpoints",
        "contiguous_memory_optimization preallocates one slot per checkpoint, so it needs the number of "
        "layers (checkpoints per forward, a positive integer), from the config or from checkpointing.configure()",
        "pass num_checkpoints=N to deepspeed.checkpointing.configure() (N: checkpoint() calls in one "
        f"forward, usually the number of layers), or set {_SECTION}.number_checkpoints",
        value=n,
    )


def _check(settings: CheckpointingSettings) -> None:
    _check_partitioning(settings)
    error = missing_slot_count(settings)
    if error is not None:
        raise error


def check_section(section: ActivationCheckpointingConfig) -> None:
    """The ``configure`` rule a config section alone can break, as a ConfigError (``config check``
    runs it): contiguous memory needs ``partition_activations``. A missing ``number_checkpoints``
    is not an error here: a script may give it to ``configure(..., num_checkpoints=N)``.

    Raises:
        ConfigError: contiguous memory without partitioning, or with a ``number_checkpoints`` < 1.
    """
    settings = CheckpointingSettings(
        **{key: getattr(section, key) for key in ActivationCheckpointingConfig.model_fields}
    )
    _check_partitioning(settings)
    if settings.number_checkpoints is not None:  # set, but not a positive count
        _check(settings)


def configure(
    mpu_: object,
    deepspeed_config: object = None,
    partition_activations: bool | None = None,
    contiguous_checkpointing: bool | None = None,
    num_checkpoints: int | None = None,
    checkpoint_in_cpu: bool | None = None,
    synchronize: bool | None = None,
    profile: bool | None = None,
) -> CheckpointingSettings:
    """DeepSpeed's ``deepspeed.checkpointing.configure``: settings from the config, then the arguments.

    Args:
        mpu_: the model-parallel unit (``get_model_parallel_group/rank/world_size``, or the
            ``tensor_`` variants); None keeps the one given before (or none).
        deepspeed_config: a ds_config path, dict or loaded config; its ``activation_checkpointing``
            section is read (absent: every key at its default).
        partition_activations, contiguous_checkpointing, num_checkpoints, checkpoint_in_cpu,
            synchronize, profile: override the section's keys when not None.

    Returns:
        The settings now active.

    Raises:
        ConfigError: contiguous memory without partitioning, or without a slot count (neither
            ``number_checkpoints`` nor ``num_checkpoints``).
    """
    settings = _settings(
        mpu_,
        deepspeed_config,
        overrides={
            "partition_activations": partition_activations,
            "contiguous_memory_optimization": contiguous_checkpointing,
            "number_checkpoints": num_checkpoints,
            "cpu_checkpointing": checkpoint_in_cpu,
            "synchronize_checkpoint_boundary": synchronize,
            "profile": profile,
        },
    )
    _check(settings)
    return _activate(settings)


def _settings(mpu_: Any, deepspeed_config: Any, overrides: dict[str, Any]) -> CheckpointingSettings:
    """The section's keys, overridden by the non-None ``overrides``, with the mpu's group."""
    section = _section(deepspeed_config)
    mpu = mpu_ if mpu_ is not None else _current.mpu
    group, rank, size = model_parallel_of(mpu)
    settings = CheckpointingSettings(
        **{key: getattr(section, key) for key in ActivationCheckpointingConfig.model_fields},
        mpu=mpu,
        mp_group=group,
        mp_rank=rank,
        mp_size=size,
    )
    return replace(settings, **{k: v for k, v in overrides.items() if v is not None})


def _activate(settings: CheckpointingSettings) -> CheckpointingSettings:
    global _current, _configured
    _current, _configured = settings, True
    return settings


def replace_current(**fields: Any) -> CheckpointingSettings:
    """Replace fields of the active settings unchecked (an assignment to one of DeepSpeed's module
    globals, :mod:`shardwise.checkpointing.globals`); ``checkpoint()`` checks what it needs."""
    global _current
    _current = replace(_current, **fields)
    return _current


def set_configured(configured: bool) -> None:
    """Set whether :func:`configure` counts as having run (DeepSpeed's ``deepspeed_checkpointing_enabled``)."""
    global _configured
    _configured = configured


def set_num_layers(nlayers: int) -> None:
    """DeepSpeed's ``set_num_layers``: the contiguous buffer's slot count."""
    global _current
    _current = replace(_current, number_checkpoints=nlayers)
    _check(_current)


def partition_activations_in_checkpoint(partition_activation: bool) -> None:
    """DeepSpeed's switch for ``partition_activations`` alone."""
    global _current
    _current = replace(_current, partition_activations=bool(partition_activation))
    _check_partitioning(_current)


def describe(settings: CheckpointingSettings | None = None) -> str:
    """One line saying what is active, for the start-up report.

    Example:
        >>> describe(CheckpointingSettings(cpu_checkpointing=True, profile=True))
        'activation checkpointing: saved activations in host memory, forward/recompute times profiled'
    """
    s = settings or _current
    parts = []
    if s.partition_activations:
        if s.mp_size > 1:
            parts.append(f"saved activations split over {s.mp_size} model-parallel ranks")
        else:
            parts.append(
                "partition_activations on, but the model-parallel group has 1 rank: nothing is split"
            )
    if s.cpu_checkpointing:
        parts.append("saved activations in host memory")
    if s.contiguous_memory_optimization and missing_slot_count(s) is None:
        parts.append(f"stored in one contiguous buffer of {s.number_checkpoints} slots")
    elif s.contiguous_memory_optimization:
        parts.append(
            "stored in one contiguous buffer whose slot count must still come from "
            "checkpointing.configure(..., num_checkpoints=N) before the first checkpoint()"
        )
    if s.synchronize_checkpoint_boundary:
        parts.append("device synchronized at each checkpoint boundary")
    if s.profile:
        parts.append("forward/recompute times profiled")
    return "activation checkpointing: " + (", ".join(parts) if parts else "default (inputs kept as they are)")


def configure_for_engine(section: ActivationCheckpointingConfig, mpu: object) -> CheckpointingSettings | None:
    """What ``initialize`` does: apply the config's section, so config-only users get it.

    A section that sets anything replaces earlier settings (as a ``configure`` call with that
    config would); a section left at its defaults keeps an earlier ``configure`` call's settings
    and only fills in the mpu, or configures the defaults when nothing was configured yet.

    ``contiguous_memory_optimization`` without ``number_checkpoints`` is not refused here: the
    slot count of an earlier ``configure(..., num_checkpoints=N)`` (or ``set_num_layers``) is
    kept, and without one it stays missing until a later ``configure`` gives it; the first
    ``checkpoint()`` still without it raises (:func:`missing_slot_count`).

    Returns:
        The settings when the section sets something (for the start-up report), else None.
    """
    if section != ActivationCheckpointingConfig():
        earlier = _current.number_checkpoints if _configured else None
        settings = _settings(mpu, section, overrides={})
        if settings.number_checkpoints is None and earlier is not None:
            settings = replace(settings, number_checkpoints=earlier)
        _check_partitioning(settings)
        return _activate(settings)
    if not _configured:
        configure(mpu)
    elif mpu is not None and _current.mpu is None:
        group, rank, size = model_parallel_of(mpu)
        _activate(replace(_current, mpu=mpu, mp_group=group, mp_rank=rank, mp_size=size))
    return None
