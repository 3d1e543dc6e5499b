"""``deepspeed.runtime.data_pipeline.curriculum_scheduler.CurriculumScheduler`` on shardwise's schedule.

Clients that drive the legacy curriculum themselves (Megatron-DeepSpeed builds one from the config's
``curriculum_learning`` section and calls ``update_difficulty(step)`` each iteration) get DeepSpeed's
class: the config dict in, ``state`` holding its keys, the difficulty computed by
:class:`shardwise.data_efficiency.schedule.CurriculumSchedule` (DeepSpeed's formulas).
A missing or inconsistent key raises shardwise's ConfigError naming it (DeepSpeed asserts).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from shardwise.data_efficiency.schedule import CurriculumSchedule

__all__ = ["CurriculumScheduler"]

_REQUIRED = ("min_difficulty", "max_difficulty", "schedule_type")


class CurriculumScheduler:
    """The difficulty of a curriculum at each step (DeepSpeed's ``CurriculumScheduler``).

    Args:
        config: a ``curriculum_learning`` section: ``min_difficulty``, ``max_difficulty``,
            ``schedule_type`` and (except ``custom``) ``schedule_config``.

    Attributes:
        state: ``min_difficulty``, ``max_difficulty``, ``current_difficulty`` (starts at the
            minimum), ``schedule_type`` and, except for ``custom``, ``schedule_config``.

    Example:
        >>> s = CurriculumScheduler({"min_difficulty": 8, "max_difficulty": 64, "schedule_type": "fixed_linear",
        ...                          "schedule_config": {"total_curriculum_step": 10, "difficulty_step": 8}})
        >>> [s.update_difficulty(step) for step in (1, 5, 10, 11)]
        [8, 32, 64, 64]
    """

    def __init__(self, config: Mapping[str, Any]) -> None:
        from shardwise.config.errors import ConfigError

        for key in _REQUIRED:
            if key not in config:
                raise ConfigError(
                    f"curriculum_learning.{key}", "is required by CurriculumScheduler", f'add "{key}"'
                )
        schedule_type = config["schedule_type"]
        schedule_config = dict(config.get("schedule_config") or {})
        self._schedule = CurriculumSchedule(
            config["min_difficulty"], config["max_difficulty"], schedule_type, schedule_config, seqlen=True
        )
        self.state: dict[str, Any] = {
            "min_difficulty": config["min_difficulty"],
            "max_difficulty": config["max_difficulty"],
            "current_difficulty": config["min_difficulty"],
            "schedule_type": schedule_type,
        }
        if schedule_type != "custom":
            self.state["schedule_config"] = config.get("schedule_config")

    def set_custom_get_difficulty(self, schedule_function: Callable[[int], Any]) -> None:
        """Use ``schedule_function(step) -> difficulty`` (schedule_type ``custom``)."""
        self._schedule.set_custom(schedule_function)

    def get_difficulty(self, global_steps: int) -> Any:
        """The schedule's difficulty at ``global_steps`` (not stored)."""
        return self._schedule.difficulty_at(global_steps)

    def update_difficulty(self, global_steps: int) -> Any:
        """Move to ``global_steps`` while below ``max_difficulty``; returns the current difficulty."""
        if self.state["current_difficulty"] < self.state["max_difficulty"]:
            self.state["current_difficulty"] = self.get_difficulty(global_steps)
        return self.state["current_difficulty"]
