"""The legacy top-level ``curriculum_learning`` section as a step hook.

On every training forward the difficulty moves to ``global_steps + 1`` and, for
``curriculum_type: "seqlen"``, the model is called with ``curriculum_seqlen=<difficulty>``
(DeepSpeed's contract, spec 3.13 / 12.1). Cutting the batch to that length is the model's job:
a model whose forward does not take the argument can be wrapped in
:class:`~shardwise.data_efficiency.truncation.SeqlenTruncation`. Evaluation forwards get no
argument, like DeepSpeed's.

Example:
    >>> from shardwise.config import load_config
    >>> from shardwise.runtime.step_hooks import ForwardContext
    >>> cfg = load_config({"train_batch_size": 2, "curriculum_learning": {"enabled": True,
    ...     "min_difficulty": 8, "max_difficulty": 64, "schedule_type": "fixed_linear",
    ...     "schedule_config": {"total_curriculum_step": 10, "difficulty_step": 8}}}).config
    >>> hook = build_legacy_curriculum_hook(cfg.curriculum_learning)
    >>> hook.adjust_forward((), {}, ForwardContext(global_step=4, training=True))
    ((), {'curriculum_seqlen': 32})
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from shardwise.config.errors import ConfigError
from shardwise.config.sections.data_efficiency import LegacyCurriculumConfig
from shardwise.data_efficiency.schedule import CurriculumSchedule
from shardwise.runtime.step_hooks import ForwardContext, StepOutcome

__all__ = ["LegacyCurriculumHook", "build_legacy_curriculum_hook"]

CURRICULUM_TYPES = ("seqlen",)


class LegacyCurriculumHook:
    """Adds ``curriculum_seqlen`` to every training forward (see the module docstring).

    Attributes:
        schedule: the difficulty schedule (its state is saved in checkpoints).
        curriculum_type: what the difficulty means (``"seqlen"``).
    """

    name = "curriculum_learning"

    def __init__(self, schedule: CurriculumSchedule, curriculum_type: str = "seqlen") -> None:
        self.schedule = schedule
        self.curriculum_type = curriculum_type

    def set_custom_schedule(self, fn: Callable[[int], Any]) -> None:
        """Use ``fn(step) -> difficulty`` for ``schedule_type: "custom"``."""
        self.schedule.set_custom(fn)

    def adjust_forward(
        self, args: tuple[object, ...], kwargs: dict[str, object], context: ForwardContext
    ) -> tuple[tuple[object, ...], dict[str, object]]:
        """Update the difficulty to ``global_step + 1`` and pass it as ``curriculum_seqlen``."""
        if not context.training:
            return args, kwargs
        difficulty = self.schedule.update(context.global_step + 1)
        if self.curriculum_type == "seqlen":
            kwargs = {**kwargs, "curriculum_seqlen": difficulty}
        return args, kwargs

    def after_optimizer_step(self, outcome: StepOutcome) -> None:
        """Nothing: the difficulty follows the step counter at the next forward."""

    def state_dict(self) -> dict[str, object]:
        """The schedule's current difficulty."""
        return self.schedule.state_dict()

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Restore the schedule's current difficulty."""
        self.schedule.load_state_dict(state)


def build_legacy_curriculum_hook(section: LegacyCurriculumConfig | None) -> LegacyCurriculumHook | None:
    """The hook for an enabled top-level ``curriculum_learning`` section, else None.

    Raises:
        ConfigError: an unknown ``curriculum_type`` or an inconsistent schedule (names the key).
    """
    if section is None or not section.enabled:
        return None
    if section.curriculum_type not in CURRICULUM_TYPES:
        raise ConfigError(
            "curriculum_learning.curriculum_type",
            f"must be one of {list(CURRICULUM_TYPES)} (the legacy curriculum only knows sequence length)",
            'set "seqlen", or use data_efficiency.data_sampling.curriculum_learning for other metrics',
            value=section.curriculum_type,
        )
    schedule = CurriculumSchedule(
        section.min_difficulty,
        section.max_difficulty,
        section.schedule_type,
        section.schedule_config,
        where="curriculum_learning",
        seqlen=section.curriculum_type == "seqlen",
    )
    return LegacyCurriculumHook(schedule, section.curriculum_type)
