"""fp16 loss scaling: a dynamic scaler with hysteresis, a static one, and a no-op for bf16/fp32.

This module is pure Python: it imports neither torch nor ``torch.distributed``. The engine
decides whether a step overflowed (see :mod:`shardwise.precision.overflow`, which agrees the
flag across ranks) and calls :meth:`LossScaler.update_scale` once per optimizer step, at the
accumulation boundary. The scaler only does the bookkeeping, so its maths is tested in
milliseconds.

The dynamic algorithm (``DynamicLossScaler``) follows DeepSpeed's ZeRO-path scaler as measured
in spec section 5.1:

* start at ``2**initial_scale_power`` with a hysteresis budget ``h = hysteresis``;
* on an overflow step, if the budget is spent (``h == 1``) halve the scale, never going below
  ``min_loss_scale``; otherwise spend one unit of the budget and keep the scale. Either way the
  step is skipped and ``last_overflow_iter`` is set to the current iteration;
* on a clean step, refill the budget first if ``consecutive_hysteresis``; then, after every
  ``loss_scale_window`` clean steps since the last overflow, double the scale (and, without
  ``consecutive_hysteresis``, refill the budget there);
* an overflow with the scale already at ``min_loss_scale`` and the budget spent raises
  :class:`LossScaleAtMinimumError`.

Design choice: one algorithm at every ZeRO stage. DeepSpeed runs two different dynamic
algorithms: ZeRO stages 1-3 use the hysteresis scaler above, while its stage-0 fp16 wrappers use
a scaler without hysteresis that silently clamps at the minimum (spec 5.2), and in 0.19.8 the
stage-0 path also forgets to multiply the loss by the scale (spec 5.5). We deliberately copy
neither: the same config behaves the same way whatever the stage. The stage-0 behaviour is still
reachable: ``hysteresis=1`` with ``raise_error_at_min_scale=False`` reproduces it exactly (the
spec's 5.2 trace is one of the unit tests).

Checkpointing: every scaler is ``Stateful`` in the sense of
``torch.distributed.checkpoint.stateful.Stateful`` (a structural protocol, so no inheritance and
no torch import is needed). ``state_dict()`` holds only JSON-serialisable plain values. On
``load_state_dict()`` the run's *state* (current scale, counters, remaining hysteresis) comes from
the checkpoint, while the *settings* (window, hysteresis, minimum, ...) stay those of the config
the run was started with, so a user can resume a run with, for example, a lower
``min_loss_scale``; any difference is logged. (DeepSpeed unpickles the whole scaler object,
settings included.)
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

from shardwise.config.errors import ConfigError
from shardwise.config.loss_scale_rules import as_positive_float, dynamic_scale_settings
from shardwise.config.loss_scale_rules import format_scale as _fmt
from shardwise.utils.logging import logger

_T = TypeVar("_T")

# The dynamic scale moves by this factor in both directions (fixed in DeepSpeed too).
SCALE_FACTOR = 2.0

# Keys every scaler's state_dict carries; the settings keys differ per kind.
_STATE_KEYS = ("kind", "cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


class LossScaleAtMinimumError(RuntimeError):
    """The gradients overflowed with the loss scale already at its minimum.

    Attributes:
        scale: the loss scale at the failing step (equal to ``min_loss_scale``).
        min_loss_scale: the configured minimum.
        iteration: the scaler's ``cur_iter`` at the failing step.
    """

    def __init__(self, scale: float, min_loss_scale: float, iteration: int) -> None:
        self.scale = scale
        self.min_loss_scale = min_loss_scale
        self.iteration = iteration
        super().__init__(
            f"fp16 gradients overflowed (inf/NaN) at loss-scaler iteration {iteration}, but the loss scale "
            f"is already at its minimum ({_fmt(scale)}, 'fp16.min_loss_scale' = {_fmt(min_loss_scale)}) "
            "and the hysteresis budget is spent. The scale cannot be lowered any further, so every "
            "following step would be skipped too; the run is stopped instead. At this point the "
            "inf/NaN rarely comes from the scale itself: usually the model diverged or the data is "
            "bad. Things to try: lower the learning rate or lengthen the warmup; enable or tighten "
            "'gradient_clipping'; check the inputs and labels for inf/NaN; train in bf16 "
            '("bf16": {"enabled": true}), which needs no loss scaling; or tolerate more overflows '
            "with a lower 'fp16.min_loss_scale' or a larger 'fp16.hysteresis'."
        )


class LossScaler(ABC):
    """The interface the engine uses: a scale, a per-step update, and checkpoint state.

    Attributes:
        cur_scale: the factor the loss is multiplied by before backward.
        cur_iter: how many optimizer steps ``update_scale`` has seen.
        last_overflow_iter: ``cur_iter`` of the latest overflow step, ``-1`` if none yet.
        cur_hysteresis: overflows still tolerated before the scale drops (always 1 when the
            scaler has no hysteresis).
    """

    kind: ClassVar[str]
    dynamic: ClassVar[bool]

    def __init__(self, scale: float) -> None:
        self.cur_scale = float(scale)
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.cur_hysteresis = 1

    @property
    def loss_scale(self) -> float:
        """The current loss scale (DeepSpeed's name for ``cur_scale``)."""
        return self.cur_scale

    def scale_loss(self, loss: _T) -> _T:
        """Return ``loss * cur_scale`` (works for tensors and plain numbers)."""
        return loss * self.cur_scale  # type: ignore[operator,return-value]

    def multiplies(self) -> bool:
        """Whether ``scale_loss`` changes the loss: a backward must then start from the scaled loss."""
        return self.dynamic or self.cur_scale != 1.0

    @abstractmethod
    def update_scale(self, overflow: bool) -> None:
        """Record one optimizer step; ``overflow`` means its gradients held inf/NaN and it was skipped."""

    def _settings(self) -> dict[str, object]:
        """The configured values, as plain Python (part of ``state_dict``)."""
        return {}

    def _apply_loaded_state(self, state: Mapping[str, Any]) -> None:
        """Take the scale and hysteresis from a same-kind checkpoint (settings already compared)."""
        self.cur_scale = float(state["cur_scale"])
        self.cur_hysteresis = int(state["cur_hysteresis"])

    def state_dict(self) -> dict[str, Any]:
        """Return the scaler's state and settings as JSON-serialisable plain values.

        Example:
            >>> scaler = DynamicLossScaler(initial_scale_power=4)
            >>> scaler.update_scale(overflow=True)
            >>> scaler.state_dict()["cur_hysteresis"]
            1
        """
        return {
            "kind": self.kind,
            "cur_scale": self.cur_scale,
            "cur_iter": self.cur_iter,
            "last_overflow_iter": self.last_overflow_iter,
            "cur_hysteresis": self.cur_hysteresis,
            **self._settings(),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the state saved by :meth:`state_dict`.

        The counters always come from the checkpoint. The scale and the remaining hysteresis come
        from it only when it was saved by the same kind of scaler; the settings always stay this
        scaler's own (a difference is logged). A checkpoint from another kind of scaler (for
        example fp16 before and bf16 now) restores only the counters, with a warning.

        Raises:
            ValueError: ``state_dict`` lacks one of the keys every scaler writes.
        """
        missing = [key for key in _STATE_KEYS if key not in state_dict]
        if missing:
            raise ValueError(
                f"loss-scaler state is missing {missing}; found keys {sorted(state_dict)}. "
                "It must come from LossScaler.state_dict(); check that the checkpoint entry is the "
                "loss scaler's and that the checkpoint is complete."
            )
        self.cur_iter = int(state_dict["cur_iter"])
        self.last_overflow_iter = int(state_dict["last_overflow_iter"])
        if state_dict["kind"] != self.kind:
            logger.warning(
                "The checkpoint's loss scaler is '%s' but this run uses '%s' (fp16/bf16 or static/dynamic "
                "changed in the config): restored only its step counters, the scale starts at %s.",
                state_dict["kind"],
                self.kind,
                _fmt(self.cur_scale),
            )
            return
        changed = {
            key: (state_dict[key], value)
            for key, value in self._settings().items()
            if key in state_dict and state_dict[key] != value
        }
        if changed:
            logger.warning(
                "Loss-scaler settings differ from the checkpoint's; using the config's: %s",
                ", ".join(f"{key} {old!r} -> {new!r}" for key, (old, new) in changed.items()),
            )
        self._apply_loaded_state(state_dict)


class DynamicLossScaler(LossScaler):
    """Dynamic fp16 loss scaling with hysteresis (spec 5.1; see the module docstring).

    Args:
        initial_scale_power: the scale starts at ``2**initial_scale_power``.
        loss_scale_window: clean steps since the last overflow before the scale doubles.
        hysteresis: overflows tolerated (the first ``hysteresis - 1`` keep the scale) before it halves.
        consecutive_hysteresis: refill the hysteresis budget on every clean step, not only when
            the scale doubles; only runs of consecutive overflows then lower the scale.
        min_loss_scale: the scale never goes below this.
        raise_error_at_min_scale: raise :class:`LossScaleAtMinimumError` when an overflow arrives
            at the minimum scale with the budget spent. When False the scale stays clamped at the
            minimum and the step is skipped silently (DeepSpeed's stage-0 behaviour).

    Raises:
        ConfigError: a setting is out of range (named by its ``fp16.*`` key).

    Example:
        >>> scaler = DynamicLossScaler(initial_scale_power=4, loss_scale_window=3, hysteresis=2)
        >>> for overflow in (False, True, True, True):
        ...     scaler.update_scale(overflow)
        >>> scaler.cur_scale, scaler.cur_hysteresis
        (4.0, 1)
    """

    kind: ClassVar[str] = "dynamic"
    dynamic: ClassVar[bool] = True

    def __init__(
        self,
        initial_scale_power: int = 16,
        loss_scale_window: int = 1000,
        hysteresis: int = 2,
        consecutive_hysteresis: bool = False,
        min_loss_scale: float = 1.0,
        raise_error_at_min_scale: bool = True,
    ) -> None:
        (
            self.initial_scale_power,
            self.loss_scale_window,
            self.hysteresis,
            self.consecutive_hysteresis,
            self.min_loss_scale,
        ) = dynamic_scale_settings(
            initial_scale_power, loss_scale_window, hysteresis, consecutive_hysteresis, min_loss_scale
        )
        self.raise_error_at_min_scale = bool(raise_error_at_min_scale)
        initial = 2.0**self.initial_scale_power
        super().__init__(initial)
        self.cur_hysteresis = self.hysteresis

    def _settings(self) -> dict[str, object]:
        return {
            "initial_scale_power": self.initial_scale_power,
            "loss_scale_window": self.loss_scale_window,
            "hysteresis": self.hysteresis,
            "consecutive_hysteresis": self.consecutive_hysteresis,
            "min_loss_scale": self.min_loss_scale,
            "raise_error_at_min_scale": self.raise_error_at_min_scale,
        }

    def _apply_loaded_state(self, state: Mapping[str, object]) -> None:
        super()._apply_loaded_state(state)
        # The config may have changed the bounds since the save: keep the state inside them.
        if self.cur_scale < self.min_loss_scale:
            logger.warning(
                "Checkpoint loss scale %s is below min_loss_scale %s; starting from the minimum.",
                _fmt(self.cur_scale),
                _fmt(self.min_loss_scale),
            )
            self.cur_scale = self.min_loss_scale
        self.cur_hysteresis = max(1, min(self.cur_hysteresis, self.hysteresis))

    def update_scale(self, overflow: bool) -> None:
        """Apply one optimizer step's outcome to the scale (spec 5.1).

        Raises:
            LossScaleAtMinimumError: ``overflow`` with the scale at ``min_loss_scale``, the hysteresis
                budget spent and ``raise_error_at_min_scale`` set. The scaler's state is left as
                it was before the call.
        """
        if overflow:
            self._on_overflow()
        else:
            self._on_clean_step()
        self.cur_iter += 1

    def _on_overflow(self) -> None:
        if self.hysteresis == 1 or self.cur_hysteresis <= 1:
            if self.cur_scale <= self.min_loss_scale:
                if self.raise_error_at_min_scale:
                    raise LossScaleAtMinimumError(self.cur_scale, self.min_loss_scale, self.cur_iter)
                logger.info(
                    "fp16 gradient overflow at iteration %d: step skipped; loss scale stays at its minimum %s.",
                    self.cur_iter,
                    _fmt(self.min_loss_scale),
                )
                self.cur_scale = self.min_loss_scale
            else:
                new_scale = max(self.cur_scale / SCALE_FACTOR, self.min_loss_scale)
                logger.info(
                    "fp16 gradient overflow at iteration %d: step skipped; loss scale %s -> %s.",
                    self.cur_iter,
                    _fmt(self.cur_scale),
                    _fmt(new_scale),
                )
                self.cur_scale = new_scale
        else:
            logger.info(
                "fp16 gradient overflow at iteration %d: step skipped; loss scale kept at %s, "
                "hysteresis %d -> %d.",
                self.cur_iter,
                _fmt(self.cur_scale),
                self.cur_hysteresis,
                self.cur_hysteresis - 1,
            )
            self.cur_hysteresis -= 1
        self.last_overflow_iter = self.cur_iter

    def _on_clean_step(self) -> None:
        if self.consecutive_hysteresis and self.cur_hysteresis != self.hysteresis:
            # DeepSpeed logs this on every clean step; we log only when something changes.
            logger.info("Clean step after overflow: hysteresis restored to %d.", self.hysteresis)
            self.cur_hysteresis = self.hysteresis
        stable_steps = self.cur_iter - self.last_overflow_iter - 1
        if stable_steps > 0 and stable_steps % self.loss_scale_window == 0:
            new_scale = self.cur_scale * SCALE_FACTOR
            logger.info(
                "No fp16 gradient overflow for %d iterations: loss scale %s -> %s.",
                self.loss_scale_window,
                _fmt(self.cur_scale),
                _fmt(new_scale),
            )
            self.cur_scale = new_scale
            if not self.consecutive_hysteresis:
                self.cur_hysteresis = self.hysteresis


class StaticLossScaler(LossScaler):
    """A fixed fp16 loss scale (``fp16.loss_scale > 0``): overflows skip the step, the scale never moves.

    Args:
        scale: the loss scale, finite and > 0.

    Raises:
        ConfigError: ``scale`` is not a finite positive number.

    Example:
        >>> scaler = StaticLossScaler(128.0)
        >>> scaler.update_scale(overflow=True)
        >>> scaler.cur_scale, scaler.last_overflow_iter
        (128.0, 0)
    """

    kind: ClassVar[str] = "static"
    dynamic: ClassVar[bool] = False

    def __init__(self, scale: float) -> None:
        super().__init__(as_positive_float("fp16.loss_scale", scale))

    def _settings(self) -> dict[str, object]:
        return {"loss_scale": self.cur_scale}

    def _apply_loaded_state(self, state: Mapping[str, object]) -> None:
        # The scale *is* the setting, so the config's value stays (a difference was logged).
        pass

    def update_scale(self, overflow: bool) -> None:
        """Record one optimizer step; an overflow only marks the step as skipped."""
        if overflow:
            logger.info(
                "fp16 gradient overflow at iteration %d: step skipped (static loss scale %s).",
                self.cur_iter,
                _fmt(self.cur_scale),
            )
            self.last_overflow_iter = self.cur_iter
        self.cur_iter += 1


class NoOpLossScaler(LossScaler):
    """Scale 1.0, for bf16 and fp32, which need no loss scaling.

    ``update_scale`` still counts steps and records non-finite ones (bf16's
    ``check_grad_overflow`` skips them), so the engine treats every precision alike.

    Example:
        >>> scaler = NoOpLossScaler()
        >>> scaler.scale_loss(3.0), scaler.cur_scale
        (3.0, 1.0)
    """

    kind: ClassVar[str] = "none"
    dynamic: ClassVar[bool] = False

    def __init__(self) -> None:
        super().__init__(1.0)

    def scale_loss(self, loss: _T) -> _T:
        """Return ``loss`` unchanged (no multiply kernel for a factor of 1)."""
        return loss

    def _apply_loaded_state(self, state: Mapping[str, object]) -> None:
        pass  # nothing but the counters to restore

    def update_scale(self, overflow: bool) -> None:
        """Record one optimizer step; an overflow only marks the step as skipped."""
        if overflow:
            logger.info("Non-finite gradients at iteration %d: step skipped.", self.cur_iter)
            self.last_overflow_iter = self.cur_iter
        self.cur_iter += 1


def build_loss_scaler(
    fp16_enabled: bool,
    loss_scale: float = 0.0,
    initial_scale_power: int = 16,
    loss_scale_window: int = 1000,
    hysteresis: int = 2,
    consecutive_hysteresis: bool = False,
    min_loss_scale: float = 1.0,
    *,
    raise_error_at_min_scale: bool = True,
) -> LossScaler:
    """Choose the scaler for the run's precision, from the ``fp16`` section's values.

    Without fp16 (bf16 or fp32) this is a :class:`NoOpLossScaler` and the other arguments are
    ignored. With fp16, ``loss_scale > 0`` gives a :class:`StaticLossScaler`, and ``0`` (the
    default) a :class:`DynamicLossScaler`; the dynamic settings are validated only then, as
    DeepSpeed does (a static config with ``min_loss_scale: 0`` is accepted).

    Raises:
        ConfigError: ``loss_scale`` is negative, not finite or a bool, or a dynamic setting is
            out of range.

    Example:
        >>> build_loss_scaler(fp16_enabled=True, initial_scale_power=8).cur_scale
        256.0
        >>> type(build_loss_scaler(fp16_enabled=True, loss_scale=512)).__name__
        'StaticLossScaler'
        >>> build_loss_scaler(fp16_enabled=False).cur_scale
        1.0
    """
    if not fp16_enabled:
        return NoOpLossScaler()
    if isinstance(loss_scale, bool) or not isinstance(loss_scale, (int, float)):
        raise ConfigError(
            "fp16.loss_scale",
            "must be a number",
            "use 0 for dynamic scaling or a positive static scale",
            loss_scale,
        )
    if not math.isfinite(loss_scale) or loss_scale < 0:
        raise ConfigError(
            "fp16.loss_scale",
            "must be finite and >= 0",
            "use 0 for dynamic scaling or a positive static scale",
            loss_scale,
        )
    if loss_scale > 0:
        return StaticLossScaler(loss_scale)
    return DynamicLossScaler(
        initial_scale_power=initial_scale_power,
        loss_scale_window=loss_scale_window,
        hysteresis=hysteresis,
        consecutive_hysteresis=consecutive_hysteresis,
        min_loss_scale=min_loss_scale,
        raise_error_at_min_scale=raise_error_at_min_scale,
    )
