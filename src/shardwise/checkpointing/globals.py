"""DeepSpeed's ``deepspeed.checkpointing`` module globals, as live views of the active settings.

Scripts (Megatron-DeepSpeed among them) read and set module globals of DeepSpeed's checkpointing
module: ``PARTITION_ACTIVATIONS``, ``CONTIGUOUS_CHECKPOINTING``, ``CPU_CHECKPOINT``, ``SYNCHRONIZE``,
``PROFILE_TIME``, ``num_layers``, ``mpu``, ``mp_rank``, ``mp_size``, ``mp_group`` and
``deepspeed_checkpointing_enabled``. shardwise keeps one
:class:`~shardwise.checkpointing.settings.CheckpointingSettings` instead of loose globals, so a
plain module attribute would go stale at the next ``configure``. :func:`install` gives the
``shardwise.checkpointing`` module a class whose properties read the settings on every access
and, when a script assigns one, replace that field of the settings (as assigning DeepSpeed's global
changes what its checkpoint does). Assignments are not checked, as DeepSpeed's are not; the first
``checkpoint()`` still refuses contiguous memory without a slot count.

Example:
    >>> from shardwise import checkpointing
    >>> _ = checkpointing.configure(None, partition_activations=True)
    >>> checkpointing.PARTITION_ACTIVATIONS, checkpointing.num_layers
    (True, None)
    >>> checkpointing.num_layers = 4
    >>> checkpointing.current_settings().number_checkpoints
    4
    >>> _ = checkpointing.configure(None)
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

from shardwise.checkpointing import settings as _settings

__all__ = ["GLOBALS", "install"]

GLOBALS: dict[str, str] = {
    "PARTITION_ACTIVATIONS": "partition_activations",
    "CONTIGUOUS_CHECKPOINTING": "contiguous_memory_optimization",
    "CPU_CHECKPOINT": "cpu_checkpointing",
    "SYNCHRONIZE": "synchronize_checkpoint_boundary",
    "PROFILE_TIME": "profile",
    "num_layers": "number_checkpoints",
    "mp_rank": "mp_rank",
    "mp_size": "mp_size",
    "mp_group": "mp_group",
}
"""DeepSpeed's global name -> the :class:`CheckpointingSettings` field it reads and writes
(``mpu`` and ``deepspeed_checkpointing_enabled`` have their own properties)."""


def _field(name: str) -> property:
    field = GLOBALS[name]

    def get(_module: ModuleType) -> Any:
        return getattr(_settings.current_settings(), field)

    def set_(_module: ModuleType, value: Any) -> None:
        _settings.replace_current(**{field: value})

    return property(get, set_, doc=f"DeepSpeed's ``{name}``: the active settings' ``{field}``.")


def _get_mpu(_module: ModuleType) -> Any:
    return _settings.current_settings().mpu


def _set_mpu(_module: ModuleType, mpu: Any) -> None:
    group, rank, size = _settings.model_parallel_of(mpu)
    _settings.replace_current(mpu=mpu, mp_group=group, mp_rank=rank, mp_size=size)


def _get_enabled(_module: ModuleType) -> bool:
    return _settings.is_configured()


def _set_enabled(_module: ModuleType, value: bool) -> None:
    _settings.set_configured(bool(value))


class CheckpointingModule(ModuleType):
    """The class of ``shardwise.checkpointing``: DeepSpeed's module globals as properties."""

    mpu = property(_get_mpu, _set_mpu, doc="DeepSpeed's ``mpu``: the model-parallel unit configured.")
    deepspeed_checkpointing_enabled = property(
        _get_enabled, _set_enabled, doc="DeepSpeed's ``deepspeed_checkpointing_enabled``: configure() ran."
    )


for _name in GLOBALS:
    setattr(CheckpointingModule, _name, _field(_name))


def install(module_name: str) -> None:
    """Give ``sys.modules[module_name]`` the live globals (idempotent)."""
    sys.modules[module_name].__class__ = CheckpointingModule
