"""DeepSpeed's cyclic and range-test LR schedulers: ``OneCycle`` (LR and momentum) and ``LRRangeTest``
(over :mod:`shardwise.schedulers.formulas`; shared stepping in :mod:`shardwise.schedulers.scheduler_base`)."""

from __future__ import annotations

from collections.abc import Sequence

from shardwise.schedulers.formulas import (
    BETA2,
    LRRangeTestSchedule,
    OneCycleSchedule,
)
from shardwise.schedulers.scheduler_base import _IterationScheduler, per_group, update_lr
from shardwise.utils.logging import logger

__all__ = ["LRRangeTest", "OneCycle"]


class OneCycle(_IterationScheduler):
    """The 1-cycle policy: LR up then down over one cycle (optionally in stairs), then a decay.

    Momentum cycles inversely and is written as ``param_group["betas"] = (mom, 0.99)``, the
    second beta forced to 0.99 as DeepSpeed does. It cycles only for optimizers whose
    ``defaults`` contain ``"betas"``; otherwise a warning is logged and cycling is off (SGD's
    ``momentum`` is never touched). At construction (iteration -1) the optimizer gets
    ``cycle_min_lr`` and ``betas = (cycle_min_mom, 0.99)``, which is DeepSpeed's choice even
    though the cycle formula gives ``cycle_max_mom`` at scale 0.

    Args:
        optimizer: a torch optimizer or an object whose ``.optimizer`` is one.
        cycle_min_lr: LR at the start and end of the cycle (number or one per group).
        cycle_max_lr: LR at the peak (number or one per group).
        decay_lr_rate: post-cycle LR decay rate; 0 disables it.
        cycle_first_step_size: length of the rising half (>0).
        cycle_second_step_size: length of the falling half (>=0; default: the first).
        cycle_first_stair_count: stairs in the rising half; 0 for a smooth ramp.
        cycle_second_stair_count: stairs in the falling half (default: the first count).
        decay_step_size: decay period; 0 disables the decay.
        cycle_momentum: whether to cycle the first Adam beta.
        cycle_min_mom: momentum at the LR peak.
        cycle_max_mom: momentum at the cycle ends.
        decay_mom_rate: post-cycle momentum growth rate (beta0 can exceed 1, as in DeepSpeed).
        last_batch_iteration: -1 for a fresh run.

    Example:
        >>> import torch
        >>> opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        >>> sched = OneCycle(opt, 0.01, 0.1, cycle_first_step_size=3)
        >>> sched.step()
        >>> round(opt.param_groups[0]["lr"], 4), round(opt.param_groups[0]["betas"][0], 4)
        (0.04, 0.8667)
    """

    def __init__(
        self,
        optimizer: object,
        cycle_min_lr: float | Sequence[float],
        cycle_max_lr: float | Sequence[float],
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float | Sequence[float] = 0.8,
        cycle_max_mom: float | Sequence[float] = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        n = len(self.optimizer.param_groups)
        bounds = zip(
            per_group("cycle_min_lr", cycle_min_lr, n),
            per_group("cycle_max_lr", cycle_max_lr, n),
            per_group("cycle_min_mom", cycle_min_mom, n),
            per_group("cycle_max_mom", cycle_max_mom, n),
        )
        self._schedules = [
            OneCycleSchedule(
                cycle_min_lr=min_lr,
                cycle_max_lr=max_lr,
                decay_lr_rate=decay_lr_rate,
                cycle_first_step_size=cycle_first_step_size,
                cycle_second_step_size=cycle_second_step_size,
                cycle_first_stair_count=cycle_first_stair_count,
                cycle_second_stair_count=cycle_second_stair_count,
                decay_step_size=decay_step_size,
                cycle_min_mom=min_mom,
                cycle_max_mom=max_mom,
                decay_mom_rate=decay_mom_rate,
            )
            for min_lr, max_lr, min_mom, max_mom in bounds
        ]
        self.cycle_momentum = bool(cycle_momentum)
        if self.cycle_momentum and "betas" not in self.optimizer.defaults:
            logger.warning(
                "OneCycle: cycle_momentum is on but %s has no 'betas' in its defaults, so momentum will not "
                "be cycled. Set cycle_momentum to false to silence this warning.",
                type(self.optimizer).__name__,
            )
            self.cycle_momentum = False
        if self.last_batch_iteration == -1:
            # DeepSpeed's start values, not the formula's (which would give cycle_max_mom).
            lrs = [s.cycle_min_lr for s in self._schedules]
            self._last_lr = update_lr(self.optimizer.param_groups, lrs)
            if self.cycle_momentum:
                self._write_betas([s.cycle_min_mom for s in self._schedules])
        else:
            self._apply()

    @property
    def min_lrs(self) -> list[float]:
        """Each group's ``cycle_min_lr`` (DeepSpeed's attribute)."""
        return [s.cycle_min_lr for s in self._schedules]

    @property
    def max_lrs(self) -> list[float]:
        """Each group's ``cycle_max_lr``."""
        return [s.cycle_max_lr for s in self._schedules]

    @property
    def step_ratio(self) -> float:
        """The rising half's share of the cycle: ``first / (first + second)`` (1.0 with no falling half)."""
        first = self._schedules[0].cycle_first_step_size
        second = self._schedules[0].cycle_second_step_size
        return first / (first + (first if second is None else second))

    def get_mom(self) -> list[tuple[float, float]] | None:
        """``(beta0, 0.99)`` per group at the current iteration, or ``None`` when not cycling."""
        if not self.cycle_momentum:
            return None
        return [(s.momentum(self.last_batch_iteration), BETA2) for s in self._schedules]

    def _write_betas(self, beta0s: Sequence[float]) -> None:
        for group, beta0 in zip(self.optimizer.param_groups, beta0s, strict=True):
            group["betas"] = (beta0, BETA2)

    def _apply(self) -> None:
        super()._apply()
        if self.cycle_momentum:
            self._write_betas([s.momentum(self.last_batch_iteration) for s in self._schedules])


class LRRangeTest(_IterationScheduler):
    """Grow the LR linearly (or in stairs) from ``lr_range_test_min_lr`` to find a good range.

    Args:
        optimizer: a torch optimizer or an object whose ``.optimizer`` is one.
        lr_range_test_min_lr: starting LR (number or one per group).
        lr_range_test_step_size: iterations per unit of growth (positive int).
        lr_range_test_step_rate: growth per unit.
        lr_range_test_staircase: grow in stairs of ``step_size`` iterations.
        last_batch_iteration: -1 for a fresh run.

    Example:
        >>> import torch
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        >>> sched = LRRangeTest(opt, lr_range_test_min_lr=0.01, lr_range_test_step_size=2)
        >>> sched.step()
        >>> round(opt.param_groups[0]["lr"], 4)
        0.015
    """

    def __init__(
        self,
        optimizer: object,
        lr_range_test_min_lr: float | Sequence[float] = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        min_lrs = per_group("lr_range_test_min_lr", lr_range_test_min_lr, len(self.optimizer.param_groups))
        self._schedules = [
            LRRangeTestSchedule(
                lr_range_test_min_lr=min_lr,
                lr_range_test_step_size=lr_range_test_step_size,
                lr_range_test_step_rate=lr_range_test_step_rate,
                lr_range_test_staircase=lr_range_test_staircase,
            )
            for min_lr in min_lrs
        ]
        self._apply()
