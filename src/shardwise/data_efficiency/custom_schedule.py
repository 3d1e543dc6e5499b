"""``engine.set_custom_curriculum_learning_schedule``: route the user's functions to the curricula."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from shardwise.data_efficiency.curriculum_hook import LegacyCurriculumHook
from shardwise.data_efficiency.sampler import CurriculumSampler

__all__ = ["set_custom_schedule"]


def set_custom_schedule(
    hooks: Iterable[Any], loader: object, schedule: Callable[[int], Any] | Mapping[str, Any]
) -> None:
    """Give the legacy curriculum hook a function, or the loader's curriculum sampler ``{metric: fn}``.

    A mapping also reaches the legacy hook through its ``"seqlen"`` entry (DeepSpeed's legacy
    engine took a single function; its data-efficiency one takes a dict).

    Raises:
        ValueError: no curriculum is enabled to receive it.
    """
    received = False
    for hook in hooks:
        if isinstance(hook, LegacyCurriculumHook):
            fn = schedule.get("seqlen") if isinstance(schedule, Mapping) else schedule
            if fn is not None:
                hook.set_custom_schedule(fn)
                received = True
    sampler = getattr(loader, "sampler", None)
    if isinstance(sampler, CurriculumSampler) and isinstance(schedule, Mapping):
        sampler.set_custom_curriculum_learning_schedule(dict(schedule))
        received = True
    if not received:
        raise ValueError(
            "set_custom_curriculum_learning_schedule: no curriculum takes this schedule; enable "
            "curriculum_learning (pass fn) or data_efficiency.data_sampling.curriculum_learning with a "
            "training_data loader (pass {metric: fn})"
        )
