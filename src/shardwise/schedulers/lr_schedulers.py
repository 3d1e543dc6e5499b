"""DeepSpeed's five LR schedulers as thin wrappers that copy pure formulas into an optimizer.

The classes keep DeepSpeed's names and constructor signatures so that ``ds_config.json``
``"scheduler": {"type": ..., "params": {...}}`` blocks and user code written against
``deepspeed.runtime.lr_schedules`` work unchanged. The maths lives in
:mod:`shardwise.schedulers.formulas`; a wrapper holds one schedule per param group.

Behaviour shared by all five (spec section 4.1):

* Construction writes the LR for ``last_batch_iteration`` into the optimizer at once (the
  first optimizer update uses it). At the default ``-1`` this is ``warmup_min_lr`` for the
  warmup schedulers, 0.0 for WarmupCosineLR, and ``cycle_min_lr``/``lr_range_test_min_lr``.
* ``step()`` advances one iteration; ``step(k)`` jumps to iteration ``k``.
* ``state_dict()`` is exactly ``{"last_batch_iteration": i}``; ``load_state_dict`` restores
  only that and leaves the optimizer alone until the next ``step()``.
* Scalar min/max values are broadcast to every param group; lists must have one value
  per group.
* They are not ``torch.optim.lr_scheduler.LRScheduler`` subclasses, like DeepSpeed's: they
  do not patch ``optimizer.step`` or add ``initial_lr`` to param groups.
"""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Integral
from typing import Any

import torch

from shardwise.config.errors import KeyedValueError
from shardwise.schedulers.formulas import (
    BETA2,
    LRRangeTestSchedule,
    OneCycleSchedule,
    WarmupCosineSchedule,
    WarmupDecaySchedule,
    WarmupSchedule,
    resolve_warmup_type,
)
from shardwise.schedulers.optimizer_access import unwrap_optimizer
from shardwise.utils.logging import logger

__all__ = [
    "LRRangeTest",
    "OneCycle",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "per_group",
    "unwrap_optimizer",
]


def per_group(name: str, value: object, num_groups: int) -> list[Any]:
    """Broadcast a scalar to ``num_groups`` values, or check that a list has one value per group.

    Raises:
        ValueError: ``"expected N value for X, got M"`` when a list has the wrong length.

    Example:
        >>> per_group("warmup_min_lr", 0.0, 2)
        [0.0, 0.0]
    """
    if isinstance(value, (list, tuple)):
        if len(value) != num_groups:
            raise KeyedValueError(
                f"expected {num_groups} value for {name}, got {len(value)}: a list must give one value per "
                f"optimizer param group. Fix: give a single number to use for every group, or a list of "
                f"{num_groups}.",
                f"scheduler.params.{name}",
                value,
            )
        return list(value)
    return [value] * num_groups


def _group_lr(group: dict[str, Any]) -> float:
    lr = group["lr"]
    return float(lr.item()) if isinstance(lr, torch.Tensor) else float(lr)


def update_lr(param_groups: Sequence[dict[str, object]], lrs: Sequence[float]) -> list[float]:
    """Write ``lrs`` into ``param_groups`` and return them.

    A tensor-valued ``lr`` (used with capturable/compiled optimizers) is filled in place so
    that anything holding a reference to it sees the new value.
    """
    for group, lr in zip(param_groups, lrs, strict=True):
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
    return list(lrs)


class _IterationScheduler:
    """Common state and stepping for the five DeepSpeed schedulers.

    Subclasses set ``self._schedules`` (one per param group) and may override
    :meth:`_apply` to write more than the LR.
    """

    _schedules: list[Any]

    def __init__(self, optimizer: object, last_batch_iteration: int) -> None:
        self.optimizer = unwrap_optimizer(optimizer)
        self.last_batch_iteration = _check_iteration(last_batch_iteration)
        self._last_lr: list[float] | None = None

    def _lrs_at(self, i: int) -> list[float]:
        return [schedule.lr(i) for schedule in self._schedules]

    def _apply(self) -> None:
        self._last_lr = update_lr(self.optimizer.param_groups, self._lrs_at(self.last_batch_iteration))

    def get_lr(self) -> list[float]:
        """The LR of every param group at the current ``last_batch_iteration``."""
        return self._lrs_at(self.last_batch_iteration)

    def get_last_lr(self) -> list[float]:
        """The LRs most recently written into the optimizer.

        Raises:
            RuntimeError: if nothing has been written yet.
        """
        if self._last_lr is None:
            raise RuntimeError(
                "get_last_lr() was called before the scheduler wrote any LR; call step() first."
            )
        return list(self._last_lr)

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance one iteration, or jump to ``last_batch_iteration``, and write the new LR.

        Called once per optimizer step (not per micro-batch), and not for steps skipped for
        fp16 overflow.
        """
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = _check_iteration(last_batch_iteration)
        self._apply()

    def state_dict(self) -> dict[str, int]:
        """Exactly ``{"last_batch_iteration": i}``, as DeepSpeed checkpoints it."""
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore ``last_batch_iteration`` only; the optimizer's LR changes at the next ``step()``."""
        if "last_batch_iteration" not in state_dict:
            raise ValueError(
                f"scheduler state_dict has keys {sorted(state_dict)}, but needs 'last_batch_iteration'. "
                "Fix: pass the dict returned by state_dict() of a shardwise/DeepSpeed scheduler."
            )
        self.last_batch_iteration = _check_iteration(state_dict["last_batch_iteration"])


def _check_iteration(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral) or value < -1:
        raise KeyedValueError(
            f"last_batch_iteration={value!r} is invalid: it must be an integer >= -1. "
            "Fix: use -1 for a fresh run or the iteration to resume from.",
            "scheduler.params.last_batch_iteration",
            value,
        )
    return int(value)


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
