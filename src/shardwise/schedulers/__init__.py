"""Learning-rate schedulers by JSON name: DeepSpeed's five, then ``torch.optim.lr_scheduler``.

A config's ``"scheduler": {"type": "WarmupLR", "params": {...}}`` block becomes a scheduler
through :func:`build_scheduler`. Our five names are looked up first; any other name must be
a class of ``torch.optim.lr_scheduler`` spelled exactly (``"StepLR"``, ``"CosineAnnealingLR"``),
which then follows torch's own semantics. :func:`lr_at` gives the pure curve of one of our five
without an optimizer, for plots and tests.

Example:
    >>> import torch
    >>> from shardwise.schedulers import build_scheduler, lr_at
    >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    >>> sched = build_scheduler("WarmupLR", {"warmup_max_lr": 0.1, "warmup_num_steps": 4}, opt)
    >>> round(lr_at("WarmupLR", {"warmup_max_lr": 0.1, "warmup_num_steps": 4, "warmup_type": "linear"}, 2), 3)
    0.05
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Mapping
from typing import Any

import torch

from shardwise.config.errors import KeyedValueError
from shardwise.schedulers.formulas import (
    LRRangeTestSchedule,
    OneCycleSchedule,
    WarmupCosineSchedule,
    WarmupDecaySchedule,
    WarmupSchedule,
)
from shardwise.schedulers.lr_schedulers import (
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    unwrap_optimizer,
)

__all__ = [
    "SCHEDULERS",
    "LRRangeTest",
    "OneCycle",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "build_scheduler",
    "lr_at",
    "momentum_at",
    "scheduler_names",
    "torch_scheduler_names",
]

SCHEDULERS: dict[str, type] = {
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
    "OneCycle": OneCycle,
    "LRRangeTest": LRRangeTest,
}
"""DeepSpeed's scheduler names (the JSON ``"type"``) to our classes."""

_SCHEDULES: dict[str, type] = {
    "WarmupLR": WarmupSchedule,
    "WarmupDecayLR": WarmupDecaySchedule,
    "WarmupCosineLR": WarmupCosineSchedule,
    "OneCycle": OneCycleSchedule,
    "LRRangeTest": LRRangeTestSchedule,
}


def torch_scheduler_names() -> list[str]:
    """Public scheduler classes of ``torch.optim.lr_scheduler`` usable by name (base classes excluded)."""
    module = torch.optim.lr_scheduler
    base = module.LRScheduler
    return sorted(
        name
        for name, obj in vars(module).items()
        if inspect.isclass(obj) and issubclass(obj, base) and obj is not base and not name.startswith("_")
    )


def scheduler_names() -> list[str]:
    """Every name :func:`build_scheduler` accepts: our five, then torch's."""
    return list(SCHEDULERS) + torch_scheduler_names()


def _did_you_mean(name: str, choices: list[str]) -> str:
    # Match case-insensitively so "warmuplr" suggests "WarmupLR".
    by_lower = {c.lower(): c for c in choices}
    close = difflib.get_close_matches(name.lower(), list(by_lower), n=1, cutoff=0.6)
    return f" Did you mean {by_lower[close[0]]!r}?" if close else ""


def _resolve_class(type_name: str) -> type:
    if not isinstance(type_name, str):
        raise KeyedValueError(
            f"scheduler.type must be a string, got {type_name!r}. Fix: use a name such as 'WarmupLR'.",
            "scheduler.type",
            type_name,
        )
    if type_name in SCHEDULERS:
        return SCHEDULERS[type_name]
    if type_name in torch_scheduler_names():
        return getattr(torch.optim.lr_scheduler, type_name)
    choices = scheduler_names()
    raise KeyedValueError(
        f"scheduler.type={type_name!r} is not a known scheduler.{_did_you_mean(type_name, choices)} Names are case-sensitive; "
        f"DeepSpeed's are {list(SCHEDULERS)} and torch.optim.lr_scheduler offers {torch_scheduler_names()}. "
        "Fix: set scheduler.type to one of these.",
        "scheduler.type",
        type_name,
    )


def _check_params(type_name: str, cls: type, params: Mapping[str, object], skip: set[str]) -> None:
    """Reject unknown and missing parameters with the accepted names, before calling ``cls``."""
    if not isinstance(params, dict):
        raise KeyedValueError(
            f"scheduler.params for {type_name} must be a mapping, got {type(params).__name__}. "
            'Fix: write it as {"name": value, ...}.',
            "scheduler.params",
            params,
        )
    signature = inspect.signature(cls)
    accepted = [
        name
        for name, p in signature.parameters.items()
        if name not in skip and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
    if not takes_kwargs:
        for key in params:
            if key not in accepted:
                hint = _did_you_mean(str(key), accepted)
                raise KeyedValueError(
                    f"scheduler.params.{key} is not a parameter of {type_name}.{hint} "
                    f"Accepted parameters: {accepted}. Fix: remove or rename it.",
                    f"scheduler.params.{key}",
                    params[key],
                )
    missing = [
        name
        for name in accepted
        if signature.parameters[name].default is inspect.Parameter.empty and name not in params
    ]
    if missing:
        raise KeyedValueError(
            f"scheduler {type_name} requires params {missing}, which are missing. "
            f"Fix: add them under scheduler.params (accepted parameters: {accepted}).",
            f"scheduler.params.{missing[0]}",
        )


def build_scheduler(type_name: str, params: Mapping[str, object] | None, optimizer: object) -> Any:
    """Build the scheduler named by a config's ``scheduler.type`` for ``optimizer``.

    Args:
        type_name: one of :data:`SCHEDULERS`, or an exact ``torch.optim.lr_scheduler`` class name.
        params: the config's ``scheduler.params`` (keyword arguments of the class).
        optimizer: a torch optimizer or a wrapper exposing it as ``.optimizer``.

    Returns:
        The scheduler. Ours write their initial LR into the optimizer at once; torch's follow
        torch's conventions (their constructor takes the initial step).

    Raises:
        ValueError: for an unknown name (with a did-you-mean), unknown or missing parameters.

    Example:
        >>> import torch
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        >>> sched = build_scheduler("StepLR", {"step_size": 3, "gamma": 0.5}, opt)
        >>> type(sched).__name__
        'StepLR'
    """
    cls = _resolve_class(type_name)
    params = {} if params is None else params
    _check_params(type_name, cls, params, skip={"optimizer"})
    return cls(unwrap_optimizer(optimizer), **params)


def _schedule(type_name: str, params: Mapping[str, object], base_lr: float | None) -> Any:
    if type_name not in _SCHEDULES:
        hint = _did_you_mean(type_name, list(_SCHEDULES)) if isinstance(type_name, str) else ""
        raise ValueError(
            f"lr_at: scheduler.type={type_name!r} has no pure formula.{hint} "
            f"Fix: use one of {list(_SCHEDULES)} (torch schedulers need an optimizer)."
        )
    cls = SCHEDULERS[type_name]
    _check_params(type_name, cls, params, skip={"optimizer", "last_batch_iteration"})
    kwargs = {k: v for k, v in params.items() if k != "cycle_momentum"}
    needs_base = type_name == "WarmupCosineLR" or (
        type_name in ("WarmupLR", "WarmupDecayLR") and kwargs.get("warmup_max_lr", _default(cls)) is None
    )
    if needs_base:
        if base_lr is None:
            raise ValueError(
                f"lr_at: {type_name} scales the optimizer's own learning rate here, so base_lr is needed. "
                "Fix: pass base_lr=<the optimizer lr>."
            )
        if type_name == "WarmupCosineLR":
            kwargs["base_lr"] = base_lr
        else:
            kwargs["warmup_max_lr"] = base_lr
    return _SCHEDULES[type_name](**kwargs)


def _default(cls: type) -> Any:
    return inspect.signature(cls).parameters["warmup_max_lr"].default


def lr_at(type_name: str, params: Mapping[str, object], step: int, base_lr: float | None = None) -> float:
    """The LR one of DeepSpeed's schedulers gives at iteration ``step``, without an optimizer.

    ``step`` is ``last_batch_iteration``: -1 is the value written at construction, and the
    optimizer's k-th update uses ``lr_at(..., k - 2)``.

    Args:
        type_name: one of :data:`SCHEDULERS`.
        params: the config's ``scheduler.params``; scalars only.
        step: the iteration.
        base_lr: the optimizer's LR, needed by WarmupCosineLR and by a warmup with
            ``warmup_max_lr`` unset or ``None``.

    Example:
        >>> lr_at("LRRangeTest", {"lr_range_test_min_lr": 0.01, "lr_range_test_step_size": 2}, 1)
        0.02
    """
    schedule = _schedule(type_name, params, base_lr)
    if type_name == "OneCycle" and step < 0:
        return schedule.cycle_min_lr  # DeepSpeed's start value (see OneCycle)
    return schedule.lr(step)


def momentum_at(params: Mapping[str, object], step: int) -> float:
    """OneCycle's first Adam beta at iteration ``step`` (``cycle_min_mom`` at -1, like the class)."""
    schedule = _schedule("OneCycle", params, None)
    return schedule.cycle_min_mom if step < 0 else schedule.momentum(step)
