"""Learning-rate curves as pure functions of the iteration, with no torch import.

Each DeepSpeed scheduler is described here by a frozen dataclass whose fields carry the
JSON parameter names (``warmup_min_lr``, ``cycle_first_step_size``, ...). The dataclass
validates its parameters once, in ``__post_init__``, and then answers ``lr(i)`` (and, for
``OneCycleSchedule``, ``momentum(i)``) for any ``i = last_batch_iteration``. The torch
wrappers in :mod:`shardwise.schedulers.lr_schedulers` hold one schedule per param group
and only copy its values into the optimizer.

The numbers follow spec section 4 (measured on DeepSpeed 0.19.8), including its quirks:

* WarmupLR uses ``N = max(2, warmup_num_steps)``, and any ``i < 0`` gives ``warmup_min_lr``.
* WarmupCosineLR gives a ratio of 0 for ``i < 0`` (the LR written at construction is 0.0).
* OneCycle's decay-phase momentum *grows*: ``beta0 = max_mom * (1 + rate * d / step)``,
  which passes 1.0 after enough steps (1.17 in the measured trace). We copy it faithfully
  so that configs tuned against DeepSpeed behave the same; it is not clamped.

Example:
    >>> from shardwise.schedulers.formulas import WarmupSchedule
    >>> s = WarmupSchedule(warmup_min_lr=0.01, warmup_max_lr=0.1, warmup_num_steps=4, warmup_type="linear")
    >>> [round(s.lr(i), 4) for i in range(5)]
    [0.01, 0.0325, 0.055, 0.0775, 0.1]
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral, Real

from shardwise.config.errors import KeyedValueError
from shardwise.utils.logging import logger

WARMUP_TYPES: tuple[str, ...] = ("log", "linear")
"""The warmup shapes DeepSpeed knows; anything else falls back to ``"log"`` with a warning."""

BETA2: float = 0.99
"""OneCycle forces the second Adam beta to this value whenever it writes momentum (measured)."""


# --------------------------------------------------------------------------- validation


def _invalid(name: str, value: object, rule: str, fix: str) -> KeyedValueError:
    return KeyedValueError(
        f"scheduler parameter {name}={value!r} is invalid: {rule}. Fix: {fix}.",
        f"scheduler.params.{name}",
        value,
    )


def check_int(name: str, value: object, *, minimum: int, fix: str) -> int:
    """Return ``value`` as an int if it is an integer ``>= minimum``, else raise ``ValueError``.

    Booleans are rejected even though ``bool`` subclasses ``int``: ``true`` in a JSON file is
    never meant as a step count.
    """
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise _invalid(name, value, f"it must be an integer >= {minimum}", fix)
    if value < minimum:
        raise _invalid(name, value, f"it must be an integer >= {minimum}", fix)
    return int(value)


def check_real(name: str, value: object, *, minimum: float | None = 0.0, fix: str) -> float:
    """Return ``value`` as a float if it is a finite number (``>= minimum`` when given)."""
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(float(value)):
        raise _invalid(name, value, "it must be a finite number", fix)
    if minimum is not None and value < minimum:
        raise _invalid(name, value, f"it must be >= {minimum}", fix)
    return float(value)


def resolve_warmup_type(warmup_type: object) -> str:
    """Return ``warmup_type`` if DeepSpeed knows it, else warn and return ``"log"`` (as DeepSpeed does)."""
    if warmup_type in WARMUP_TYPES:
        return str(warmup_type)
    logger.warning(
        "warmup_type=%r is not one of %s; using 'log' as DeepSpeed does. Set warmup_type to 'log' or "
        "'linear' to silence this warning.",
        warmup_type,
        list(WARMUP_TYPES),
    )
    return "log"


# --------------------------------------------------------------------------- shared pieces


def warmup_gamma(i: int, warmup_num_steps: int, warmup_type: str) -> float:
    """Fraction of the warmup done at iteration ``i``: 0 at ``i = 0``, 1 from ``i = N`` on.

    ``N = max(2, warmup_num_steps)``: DeepSpeed raises one-step warmups to two so that the
    log curve never divides by ``log(1) = 0``. For ``i < 0`` the result is 0.

    Args:
        i: the scheduler iteration (``last_batch_iteration``).
        warmup_num_steps: the configured warmup length (a positive int).
        warmup_type: ``"log"`` or ``"linear"``.
    """
    n = max(2, warmup_num_steps)
    if i < 0:
        return 0.0
    if i >= n:
        return 1.0
    if warmup_type == "log":
        return math.log(i + 1) / math.log(n)
    if warmup_type == "linear":
        return i / n
    raise _invalid(
        "warmup_type", warmup_type, f"it must be one of {list(WARMUP_TYPES)}", "use 'log' or 'linear'"
    )


# --------------------------------------------------------------------------- schedules


@dataclass(frozen=True)
class WarmupSchedule:
    """WarmupLR: rise from ``warmup_min_lr`` to ``warmup_max_lr`` over ``N`` steps, then hold.

    ``lr(i) = min + (max - min) * gamma(i)`` with ``gamma`` from :func:`warmup_gamma`.
    """

    warmup_min_lr: float = 0.0
    warmup_max_lr: float = 0.001
    warmup_num_steps: int = 1000
    warmup_type: str = "log"

    def __post_init__(self) -> None:
        check_real("warmup_min_lr", self.warmup_min_lr, fix="use a learning rate >= 0, e.g. 0.0")
        check_real("warmup_max_lr", self.warmup_max_lr, fix="use a learning rate >= 0, e.g. 0.001")
        check_int(
            "warmup_num_steps", self.warmup_num_steps, minimum=1, fix="use a positive step count like 1000"
        )
        object.__setattr__(self, "warmup_type", resolve_warmup_type(self.warmup_type))

    def gamma(self, i: int) -> float:
        """Warmup progress at iteration ``i`` (see :func:`warmup_gamma`)."""
        return warmup_gamma(i, self.warmup_num_steps, self.warmup_type)

    def lr(self, i: int) -> float:
        """The learning rate at iteration ``i``."""
        return self.warmup_min_lr + (self.warmup_max_lr - self.warmup_min_lr) * self.gamma(i)


@dataclass(frozen=True)
class WarmupDecaySchedule(WarmupSchedule):
    """WarmupDecayLR: WarmupLR, then a linear decay reaching 0 at ``total_num_steps`` and staying there.

    For ``i >= N``: ``gamma = max(0, (T - i) / max(1, T - N))``.
    """

    total_num_steps: int = 1000

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int(
            "total_num_steps", self.total_num_steps, minimum=0, fix="set it to the number of optimizer steps"
        )

    def gamma(self, i: int) -> float:
        """Warmup progress before ``N``, remaining decay fraction from ``N`` on."""
        n = max(2, self.warmup_num_steps)
        if i < n:
            return warmup_gamma(i, self.warmup_num_steps, self.warmup_type)
        total = self.total_num_steps
        return max(0.0, (total - i) / max(1, total - n))


@dataclass(frozen=True)
class WarmupCosineSchedule:
    """WarmupCosineLR: a ratio of each group's own construction-time LR (``base_lr``).

    Warmup (``i < N``): ``ratio = wmr + r * (1 - wmr)`` with ``r`` the log or linear progress.
    Afterwards ``p = min(1, (i - N + 1) / max(1, T - N))`` and
    ``ratio = max(0, cmr + (1 - cmr) * (1 + cos(pi * p)) / 2)``; it stays at ``cmr`` after ``T``.
    For ``i < 0`` the ratio is 0, so the LR written at construction is 0.0 (measured).
    """

    total_num_steps: int
    base_lr: float = 1.0
    warmup_min_ratio: float = 0.0
    warmup_num_steps: int = 1000
    cos_min_ratio: float = 0.0001
    warmup_type: str = "log"

    def __post_init__(self) -> None:
        check_int(
            "total_num_steps", self.total_num_steps, minimum=0, fix="set it to the number of optimizer steps"
        )
        check_real("base_lr", self.base_lr, fix="give the optimizer a learning rate >= 0")
        check_real("warmup_min_ratio", self.warmup_min_ratio, fix="use a ratio such as 0.0 or 0.01")
        check_int(
            "warmup_num_steps", self.warmup_num_steps, minimum=1, fix="use a positive step count like 1000"
        )
        check_real("cos_min_ratio", self.cos_min_ratio, fix="use a ratio such as 0.0001")
        object.__setattr__(self, "warmup_type", resolve_warmup_type(self.warmup_type))

    def ratio(self, i: int) -> float:
        """The multiplier applied to ``base_lr`` at iteration ``i``."""
        if i < 0:
            return 0.0
        n = max(2, self.warmup_num_steps)
        if i < n:
            r = warmup_gamma(i, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + r * (1.0 - self.warmup_min_ratio)
        progress = min(1.0, (i - n + 1) / max(1, self.total_num_steps - n))
        cosine = (1.0 + math.cos(math.pi * progress)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def lr(self, i: int) -> float:
        """The learning rate at iteration ``i``."""
        return self.base_lr * self.ratio(i)


@dataclass(frozen=True)
class OneCycleSchedule:
    """OneCycle: a triangular (optionally staircase) cycle, then an optional hyperbolic decay.

    With ``s1``/``s2`` the two half lengths, ``total = s1 + s2`` and ``b = i + 1``, the cycle
    position is ``ci = b mod total``. The spec writes the scale as ``x / ratio`` or
    ``(x - 1) / (ratio - 1)`` with ``x = ci / total`` and ``ratio = s1 / total``; we compute the
    algebraically identical ``ci / s1`` (rising half, ``ci <= s1``) and ``(total - ci) / s2``
    (falling half) in integers where possible, so stair boundaries are exact. A stair count
    ``c > 0`` for a half replaces the scale by ``floor(ci * c / s1) / c`` (or with
    ``total - ci`` and ``s2``).

    Decay (``i >= total``, ``d = i - total + 1``): ``lr = min_lr / (1 + lr_rate * d / step)`` and
    ``beta0 = max_mom * (1 + mom_rate * d / step)``; a zero rate or ``decay_step_size == 0``
    keeps ``min_lr`` / ``max_mom``. ``beta0`` is not clamped (see the module docstring).
    """

    cycle_min_lr: float
    cycle_max_lr: float
    decay_lr_rate: float = 0.0
    cycle_first_step_size: int = 2000
    cycle_second_step_size: int | None = None
    cycle_first_stair_count: int = 0
    cycle_second_stair_count: int | None = None
    decay_step_size: int = 0
    cycle_min_mom: float = 0.8
    cycle_max_mom: float = 0.9
    decay_mom_rate: float = 0.0

    def __post_init__(self) -> None:
        check_real("cycle_min_lr", self.cycle_min_lr, fix="use a learning rate >= 0, e.g. 0.01")
        check_real("cycle_max_lr", self.cycle_max_lr, fix="use a learning rate >= 0, e.g. 0.1")
        check_real("decay_lr_rate", self.decay_lr_rate, fix="use a rate >= 0; 0 disables the LR decay")
        check_int(
            "cycle_first_step_size", self.cycle_first_step_size, minimum=1, fix="use a positive step count"
        )
        if self.cycle_second_step_size is not None:
            check_int(
                "cycle_second_step_size",
                self.cycle_second_step_size,
                minimum=0,
                fix="use a step count >= 0, or leave it unset to mirror cycle_first_step_size",
            )
        # Stair counts <= 0 mean "no staircase"; DeepSpeed's CLI even defaults them to -1.
        check_int(
            "cycle_first_stair_count", self.cycle_first_stair_count, minimum=-1, fix="use 0 for no stairs"
        )
        if self.cycle_second_stair_count is not None:
            check_int(
                "cycle_second_stair_count",
                self.cycle_second_stair_count,
                minimum=-1,
                fix="use 0 for no stairs",
            )
        check_int("decay_step_size", self.decay_step_size, minimum=0, fix="use 0 to disable the decay phase")
        check_real("cycle_min_mom", self.cycle_min_mom, fix="use a momentum such as 0.8")
        check_real("cycle_max_mom", self.cycle_max_mom, fix="use a momentum such as 0.9")
        check_real(
            "decay_mom_rate", self.decay_mom_rate, fix="use a rate >= 0; 0 disables the momentum decay"
        )

    @property
    def first_step_size(self) -> int:
        """``s1``, the length of the rising half."""
        return self.cycle_first_step_size

    @property
    def second_step_size(self) -> int:
        """``s2``, the length of the falling half (defaults to ``s1``)."""
        s2 = self.cycle_second_step_size
        return self.cycle_first_step_size if s2 is None else s2

    @property
    def total_size(self) -> int:
        """``s1 + s2``: iterations ``0 .. total - 1`` are the cycle, the rest is decay."""
        return self.first_step_size + self.second_step_size

    @property
    def second_stair_count(self) -> int:
        """Stairs in the falling half (defaults to the first half's count)."""
        c2 = self.cycle_second_stair_count
        return self.cycle_first_stair_count if c2 is None else c2

    def scale(self, i: int) -> float:
        """The cycle scale ``sf`` in [0, 1] at iteration ``i`` (meaningful for ``i < total``)."""
        s1, s2, total = self.first_step_size, self.second_step_size, self.total_size
        ci = (i + 1) % total
        if ci <= s1:
            # ci == s1 is the peak; it belongs to the rising half (x <= ratio in the spec).
            stairs = self.cycle_first_stair_count
            return (ci * stairs // s1) / stairs if stairs > 0 else ci / s1
        # Here ci > s1 so s2 >= 1: the falling half is never empty when we reach it.
        remaining = total - ci
        stairs = self.second_stair_count
        return (remaining * stairs // s2) / stairs if stairs > 0 else remaining / s2

    def _decay_factor(self, i: int, rate: float) -> float:
        if rate == 0 or self.decay_step_size == 0:
            return 0.0
        return rate * (i - self.total_size + 1) / self.decay_step_size

    def lr(self, i: int) -> float:
        """The learning rate at iteration ``i``."""
        if i < self.total_size:
            return self.cycle_min_lr + (self.cycle_max_lr - self.cycle_min_lr) * self.scale(i)
        return self.cycle_min_lr / (1.0 + self._decay_factor(i, self.decay_lr_rate))

    def momentum(self, i: int) -> float:
        """The first Adam beta at iteration ``i`` (the second is always :data:`BETA2`)."""
        if i < self.total_size:
            return self.cycle_max_mom - (self.cycle_max_mom - self.cycle_min_mom) * self.scale(i)
        return self.cycle_max_mom * (1.0 + self._decay_factor(i, self.decay_mom_rate))


@dataclass(frozen=True)
class LRRangeTestSchedule:
    """LRRangeTest: ``lr = min_lr * (1 + step_rate * interval)`` with ``interval = (i + 1) / step_size``.

    With ``lr_range_test_staircase`` the interval is floored, giving plateaus of
    ``step_size`` iterations. At ``i = -1`` the LR is ``min_lr``.
    """

    lr_range_test_min_lr: float = 1e-3
    lr_range_test_step_size: int = 2000
    lr_range_test_step_rate: float = 1.0
    lr_range_test_staircase: bool = False

    def __post_init__(self) -> None:
        check_real(
            "lr_range_test_min_lr", self.lr_range_test_min_lr, fix="use a learning rate >= 0, e.g. 1e-3"
        )
        check_int(
            "lr_range_test_step_size",
            self.lr_range_test_step_size,
            minimum=1,
            fix="use a positive step count",
        )
        check_real("lr_range_test_step_rate", self.lr_range_test_step_rate, fix="use a rate >= 0, e.g. 1.0")
        if not isinstance(self.lr_range_test_staircase, bool):
            raise _invalid(
                "lr_range_test_staircase",
                self.lr_range_test_staircase,
                "it must be a boolean",
                "use true or false",
            )

    def lr(self, i: int) -> float:
        """The learning rate at iteration ``i``."""
        step_size = self.lr_range_test_step_size
        if self.lr_range_test_staircase:
            interval: float = float((i + 1) // step_size)
        else:
            interval = (i + 1) / step_size
        return self.lr_range_test_min_lr * (1.0 + self.lr_range_test_step_rate * interval)
