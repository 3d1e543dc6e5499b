"""What DeepSpeed's five LR schedulers share: :class:`_IterationScheduler` (the iteration counter,
``step``, ``get_lr``/``get_last_lr``, ``state_dict``), :func:`per_group` (one value per param group)
and :func:`update_lr` (writing LRs into an optimizer). The schedulers themselves are in
:mod:`shardwise.schedulers.warmup_schedulers` and :mod:`shardwise.schedulers.cyclic_schedulers`.
"""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Integral
from typing import Any

import torch

from shardwise.config.errors import KeyedValueError
from shardwise.schedulers.optimizer_access import unwrap_optimizer

__all__ = ["per_group", "update_lr"]


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
