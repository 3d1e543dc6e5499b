"""DeepSpeed's warmup LR schedulers: ``WarmupLR``, ``WarmupDecayLR`` and ``WarmupCosineLR``
(over :mod:`shardwise.schedulers.formulas`; shared stepping in :mod:`shardwise.schedulers.scheduler_base`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from shardwise.schedulers.formulas import (
    WarmupCosineSchedule,
    WarmupDecaySchedule,
    WarmupSchedule,
    resolve_warmup_type,
)
from shardwise.schedulers.scheduler_base import _group_lr, _IterationScheduler, per_group
from shardwise.utils.logging import logger

__all__ = ["WarmupCosineLR", "WarmupDecayLR", "WarmupLR"]


class WarmupLR(_IterationScheduler):
    """Warm the LR up from ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps``, then hold.

    Args:
        optimizer: a torch optimizer or an object whose ``.optimizer`` is one.
        warmup_min_lr: starting LR, a number or one per param group.
        warmup_max_lr: final LR, a number or one per param group; ``None`` keeps each group's
            current LR.
        warmup_num_steps: warmup length (positive int; values below 2 act as 2).
        warmup_type: ``"log"`` or ``"linear"``; anything else warns and uses ``"log"``.
        last_batch_iteration: -1 for a fresh run.

    Example:
        >>> import torch
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        >>> sched = WarmupLR(opt, warmup_min_lr=0.0, warmup_num_steps=4, warmup_type="linear")
        >>> sched.step(); sched.step()
        >>> round(opt.param_groups[0]["lr"], 4)
        0.025
    """

    def __init__(
        self,
        optimizer: object,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        groups = self.optimizer.param_groups
        min_lrs = per_group("warmup_min_lr", warmup_min_lr, len(groups))
        if warmup_max_lr is None:
            max_lrs = [_group_lr(g) for g in groups]
        else:
            max_lrs = per_group("warmup_max_lr", warmup_max_lr, len(groups))
        warmup_type = resolve_warmup_type(warmup_type)
        self._schedules = self._build(min_lrs, max_lrs, warmup_num_steps, warmup_type)
        self._apply()

    @property
    def min_lrs(self) -> list[float]:
        """Each group's ``warmup_min_lr`` (DeepSpeed's attribute)."""
        return [s.warmup_min_lr for s in self._schedules]

    @property
    def max_lrs(self) -> list[float]:
        """Each group's ``warmup_max_lr`` (the group's own LR when none was given)."""
        return [s.warmup_max_lr for s in self._schedules]

    @property
    def warmup_num_steps(self) -> int:
        """The warmup length as used (at least 2, as DeepSpeed)."""
        return max(2, self._schedules[0].warmup_num_steps)

    @property
    def warmup_type(self) -> str:
        """``"log"`` or ``"linear"`` (an unknown type reads as ``"log"``)."""
        return self._schedules[0].warmup_type

    def _build(
        self, min_lrs: list[Any], max_lrs: list[Any], warmup_num_steps: int, warmup_type: str
    ) -> list[WarmupSchedule]:
        return [
            WarmupSchedule(
                warmup_min_lr=lo, warmup_max_lr=hi, warmup_num_steps=warmup_num_steps, warmup_type=warmup_type
            )
            for lo, hi in zip(min_lrs, max_lrs)
        ]

    def get_lr(self) -> list[float]:
        """The LR of every group; before the first ``step()`` this is ``warmup_min_lr`` (with a warning)."""
        if self.last_batch_iteration < 0:
            logger.warning("get_lr() called before the scheduler's first step(): returning warmup_min_lr")
        return super().get_lr()


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then a linear decay to 0 at ``total_num_steps``.

    Args:
        optimizer: a torch optimizer or an object whose ``.optimizer`` is one.
        total_num_steps: the step at which the LR reaches 0 (required).
        warmup_min_lr: starting LR, a number or one per param group.
        warmup_max_lr: peak LR, a number or one per param group (default 0.001; ``None`` keeps
            each group's current LR).
        warmup_num_steps: warmup length (positive int; values below 2 act as 2).
        warmup_type: ``"log"`` or ``"linear"``.
        last_batch_iteration: -1 for a fresh run.

    Example:
        >>> import torch
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        >>> sched = WarmupDecayLR(opt, total_num_steps=10, warmup_max_lr=0.1, warmup_num_steps=4)
        >>> sched.step(9)
        >>> round(opt.param_groups[0]["lr"], 5)
        0.01667
    """

    def __init__(
        self,
        optimizer: object,
        total_num_steps: int,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = total_num_steps
        super().__init__(
            optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration
        )
        if isinstance(total_num_steps, int) and total_num_steps < warmup_num_steps:
            logger.warning(
                "total_num_steps %d is less than warmup_num_steps %d: the LR decays right after warmup",
                total_num_steps,
                warmup_num_steps,
            )

    def _build(
        self, min_lrs: list[Any], max_lrs: list[Any], warmup_num_steps: int, warmup_type: str
    ) -> list[WarmupSchedule]:
        return [
            WarmupDecaySchedule(
                warmup_min_lr=lo,
                warmup_max_lr=hi,
                warmup_num_steps=warmup_num_steps,
                warmup_type=warmup_type,
                total_num_steps=self.total_num_steps,
            )
            for lo, hi in zip(min_lrs, max_lrs)
        ]


class WarmupCosineLR(_IterationScheduler):
    """Scale each group's construction-time LR by a warmup ratio, then a cosine down to ``cos_min_ratio``.

    The LR written at construction is 0.0, so the first update does not move the weights.

    Args:
        optimizer: a torch optimizer or an object whose ``.optimizer`` is one.
        total_num_steps: the step at which the cosine reaches ``cos_min_ratio`` (required).
        warmup_min_ratio: ratio at iteration 0.
        warmup_num_steps: warmup length (positive int; values below 2 act as 2).
        cos_min_ratio: final ratio.
        warmup_type: ``"log"`` or ``"linear"``.
        last_batch_iteration: -1 for a fresh run.

    Example:
        >>> import torch
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        >>> sched = WarmupCosineLR(opt, total_num_steps=10, warmup_num_steps=4, warmup_type="linear")
        >>> opt.param_groups[0]["lr"]
        0.0
    """

    def __init__(
        self,
        optimizer: object,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.org_lrs = [_group_lr(g) for g in self.optimizer.param_groups]
        warmup_type = resolve_warmup_type(warmup_type)
        self._schedules = [
            WarmupCosineSchedule(
                total_num_steps=total_num_steps,
                base_lr=org_lr,
                warmup_min_ratio=warmup_min_ratio,
                warmup_num_steps=warmup_num_steps,
                cos_min_ratio=cos_min_ratio,
                warmup_type=warmup_type,
            )
            for org_lr in self.org_lrs
        ]
        if isinstance(total_num_steps, int) and total_num_steps < warmup_num_steps:
            logger.warning(
                "total_num_steps %d is less than warmup_num_steps %d: the cosine starts right after warmup",
                total_num_steps,
                warmup_num_steps,
            )
        self._apply()

    def get_lr_ratio(self) -> float:
        """The multiplier of each group's construction-time LR at the current iteration (0.0 before the first step)."""
        return self._schedules[0].ratio(self.last_batch_iteration)

    @property
    def warmup_num_steps(self) -> int:
        """The warmup length as used (at least 2, as DeepSpeed)."""
        return max(2, self._schedules[0].warmup_num_steps)

    @property
    def total_num_steps(self) -> int:
        """The step at which the cosine reaches ``cos_min_ratio``."""
        return self._schedules[0].total_num_steps

    @property
    def warmup_type(self) -> str:
        """``"log"`` or ``"linear"`` (an unknown type reads as ``"log"``)."""
        return self._schedules[0].warmup_type
