"""Difficulty schedules: curriculum learning's and random-LTD's (spec section 12).

:class:`CurriculumSchedule` gives the difficulty at a step for the legacy top-level
``curriculum_learning`` section and for every ``data_sampling`` curriculum metric;
:class:`RandomLTDSchedule` gives the number of tokens random-LTD layers keep. The formulas are
DeepSpeed's (0.19.8), including its rule that a fixed_root difficulty never falls below
``min_difficulty`` rounded up to ``difficulty_step``.

Example:
    >>> s = CurriculumSchedule(8, 1024, "fixed_linear", {"total_curriculum_step": 100, "difficulty_step": 8})
    >>> [s.update(step) for step in (0, 1, 10, 50, 99, 100, 200)]
    [8, 16, 104, 512, 1008, 1024, 1024]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from shardwise.config.errors import ConfigError
from shardwise.utils.logging import logger

__all__ = ["CurriculumSchedule", "RandomLTDSchedule", "fixed_root_difficulty"]

SCHEDULE_TYPES = ("fixed_linear", "fixed_root", "fixed_discrete", "custom")


def fixed_root_difficulty(
    step: int, min_d: float, max_d: float, total_steps: int, difficulty_step: int, root_degree: float
) -> int:
    """``floor((step / T) ** (1/r) * (max - min) + min)``, rounded down to a multiple of the
    difficulty step, kept between ``ceil(min / k) * k`` and ``max``.

    Example:
        >>> [fixed_root_difficulty(s, 8, 1024, 100, 8, 2) for s in (0, 1, 10, 50, 99, 100)]
        [8, 104, 328, 720, 1016, 1024]
    """
    d = math.floor((step / total_steps) ** (1.0 / root_degree) * (max_d - min_d) + min_d)
    d -= d % difficulty_step
    d = max(d, math.ceil(min_d / difficulty_step) * difficulty_step)
    return int(min(d, max_d))


def _need(config: Mapping[str, Any], key: str, where: str, kind: type = int) -> Any:
    if key not in config:
        raise ConfigError(
            f"{where}.schedule_config.{key}",
            "is required by this schedule_type",
            f'add "{key}" to {where}.schedule_config',
        )
    value = config[key]
    if kind is list:
        if not isinstance(value, list) or not value:
            raise ConfigError(
                f"{where}.schedule_config.{key}", "must be a non-empty list", "give a list", value=value
            )
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(
            f"{where}.schedule_config.{key}", "must be a positive number", "set a value > 0", value=value
        )
    return value


class CurriculumSchedule:
    """The difficulty at each step: starts at ``min_difficulty``, grows with the schedule, and
    stops being updated once it reaches ``max_difficulty`` (DeepSpeed's ``CurriculumScheduler``).

    Args:
        min_difficulty: the first difficulty.
        max_difficulty: the last one.
        schedule_type: ``fixed_linear``, ``fixed_root``, ``fixed_discrete`` or ``custom``.
        schedule_config: the type's keys (``total_curriculum_step``, ``difficulty_step``,
            ``root_degree``; ``difficulty`` and ``max_step`` lists for fixed_discrete).
        where: the config path, for error messages.
        seqlen: the difficulty is a sequence length: warn when the step is not a multiple of 8.

    Raises:
        ConfigError: a required key is missing or inconsistent (the message names it).
    """

    def __init__(
        self,
        min_difficulty: float,
        max_difficulty: float,
        schedule_type: str,
        schedule_config: Mapping[str, Any],
        where: str = "curriculum_learning",
        seqlen: bool = False,
    ) -> None:
        if schedule_type not in SCHEDULE_TYPES:
            raise ConfigError(
                f"{where}.schedule_type",
                f"must be one of {list(SCHEDULE_TYPES)}",
                "pick one",
                value=schedule_type,
            )
        if min_difficulty > max_difficulty:
            raise ConfigError(
                f"{where}.min_difficulty",
                f"must not exceed max_difficulty ({max_difficulty})",
                "lower min_difficulty or raise max_difficulty",
                value=min_difficulty,
            )
        self.min_difficulty = min_difficulty
        self.max_difficulty = max_difficulty
        self.schedule_type = schedule_type
        self.schedule_config = dict(schedule_config)
        self.where = where
        self.current = min_difficulty
        self._custom: Callable[[int], float] | None = None
        if schedule_type in ("fixed_linear", "fixed_root"):
            _need(schedule_config, "total_curriculum_step", where)
            k = _need(schedule_config, "difficulty_step", where)
            if schedule_type == "fixed_root":
                _need(schedule_config, "root_degree", where)
            if seqlen and k % 8:
                logger.warning(
                    "%s.schedule_config.difficulty_step = %s is not a multiple of 8: with fp16 a sequence "
                    "length that is a multiple of 8 uses Tensor Cores",
                    where,
                    k,
                )
        elif schedule_type == "fixed_discrete":
            difficulty = _need(schedule_config, "difficulty", where, list)
            max_step = _need(schedule_config, "max_step", where, list)
            if len(difficulty) != len(max_step) + 1:
                raise ConfigError(
                    f"{where}.schedule_config.difficulty",
                    f"needs exactly one more entry than max_step ({len(max_step)}), got {len(difficulty)}",
                    "give one difficulty per max_step plus the final difficulty",
                    value=difficulty,
                )

    def set_custom(self, fn: Callable[[int], float]) -> None:
        """Use ``fn(step) -> difficulty`` (schedule_type ``custom``)."""
        self._custom = fn

    def difficulty_at(self, step: int) -> Any:
        """The schedule's value at ``step`` (without the stop-at-max rule)."""
        cfg = self.schedule_config
        if self.schedule_type == "fixed_discrete":
            for difficulty, max_step in zip(cfg["difficulty"], cfg["max_step"], strict=False):
                if step <= max_step:
                    return difficulty
            return cfg["difficulty"][-1]
        if self.schedule_type == "custom":
            if self._custom is None:
                raise RuntimeError(
                    f"{self.where}.schedule_type is 'custom' but no schedule function was given: call "
                    "engine.set_custom_curriculum_learning_schedule(fn) before training"
                )
            return self._custom(step)
        degree = cfg.get("root_degree", 1) if self.schedule_type == "fixed_root" else 1
        return fixed_root_difficulty(
            step,
            self.min_difficulty,
            self.max_difficulty,
            cfg["total_curriculum_step"],
            cfg["difficulty_step"],
            degree,
        )

    def update(self, step: int) -> Any:
        """Move to ``step`` (while below the maximum) and return the current difficulty."""
        if self.current < self.max_difficulty:
            self.current = self.difficulty_at(step)
        return self.current

    def state_dict(self) -> dict[str, Any]:
        """The current difficulty (all that a resume needs)."""
        return {"current_difficulty": self.current}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output."""
        self.current = state["current_difficulty"]


class RandomLTDSchedule:
    """Tokens kept by random-LTD layers: ``min_value`` growing linearly to ``max_value`` over
    ``require_steps``, in multiples of ``seq_per_step``; counts the layer-tokens consumed.

    Example:
        >>> s = RandomLTDSchedule(128, 2048, 200, 16, total_layers=24, ltd_layers=22, global_batch_size=8)
        >>> [s.update(step) for step in (0, 1, 50)], s.consumed_layer_tokens
        ([128, 128, 608], 250368)
    """

    def __init__(
        self,
        min_value: int,
        max_value: int,
        require_steps: int,
        seq_per_step: int,
        *,
        total_layers: int,
        ltd_layers: int,
        global_batch_size: int,
    ) -> None:
        self.min_value = min_value
        self.max_value = max_value
        self.require_steps = require_steps
        self.seq_per_step = seq_per_step
        self.total_layers = total_layers
        self.ltd_layers = ltd_layers
        self.global_batch_size = global_batch_size
        self.current_value = min_value
        self.current_steps = -1
        self.consumed_layer_tokens = 0

    def value_at(self, step: int) -> int:
        """The schedule's kept length at ``step``."""
        value = math.floor(step / self.require_steps * (self.max_value - self.min_value) + self.min_value)
        value -= value % self.seq_per_step
        return int(min(value, self.max_value))

    def update(self, step: int) -> int:
        """Move to ``step`` (once per step: the consumed count adds the step's tokens once)."""
        if self.current_value < self.max_value:
            self.current_value = self.value_at(step)
        if step != self.current_steps:
            full_layers = self.total_layers - self.ltd_layers
            per_sample = self.current_value * self.ltd_layers + self.max_value * full_layers
            self.consumed_layer_tokens += self.global_batch_size * per_sample
            self.current_steps = step
        return self.current_value

    def state_dict(self) -> dict[str, int]:
        """DeepSpeed's keys: consumed_layer_tokens, current_steps, current_value, min/max_value."""
        return {
            "consumed_layer_tokens": self.consumed_layer_tokens,
            "current_steps": self.current_steps,
            "current_value": self.current_value,
            "min_value": self.min_value,
            "max_value": self.max_value,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output."""
        self.consumed_layer_tokens = int(state["consumed_layer_tokens"])
        self.current_steps = int(state["current_steps"])
        self.current_value = int(state["current_value"])
