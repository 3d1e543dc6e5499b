"""Steps with non-finite gradients, in every precision: warn, count, and stop a stuck run.

A ZeRO strategy skips the update of any step whose global gradient norm is inf/NaN (the
norm's all-reduce already tells every rank the same, so no extra collective) and the engine
counts it in ``skipped_steps``. This module decides what else happens, per optimizer step:

- an fp16 overflow while the dynamic loss scaler can still lower its scale is the scaler's
  normal work: it logs and lowers the scale, nothing is added here;
- any other skipped step (fp32, bf16, a static fp16 scale, a dynamic one at its minimum) logs
  a warning naming the global step and counts as one more *consecutive* non-finite step;
- ``max_consecutive_nonfinite_steps`` of those in a row raise :class:`NonFiniteStepsError`:
  the run is not learning any more. An applied step resets the count.
"""

from __future__ import annotations

from shardwise.precision.loss_scaler import DynamicLossScaler, LossScaler
from shardwise.utils.logging import logger

__all__ = ["NonFiniteSteps", "NonFiniteStepsError", "scaler_adapts"]


def scaler_adapts(scaler: LossScaler) -> bool:
    """Whether an overflow now is answered by the loss scaler lowering its scale (dynamic fp16
    scaling above ``min_loss_scale``, hysteresis included).

    Example:
        >>> from shardwise.precision.loss_scaler import build_loss_scaler
        >>> scaler_adapts(build_loss_scaler(fp16_enabled=True)), scaler_adapts(build_loss_scaler(fp16_enabled=False))
        (True, False)
    """
    return isinstance(scaler, DynamicLossScaler) and scaler.cur_scale > scaler.min_loss_scale


class NonFiniteStepsError(RuntimeError):
    """Too many optimizer steps in a row had non-finite gradients."""


class NonFiniteSteps:
    """Tracks consecutive non-finite optimizer steps (see the module docstring).

    Args:
        limit: ``max_consecutive_nonfinite_steps`` (>= 1).

    Example:
        >>> guard = NonFiniteSteps(limit=2)
        >>> guard.record(step=7, applied=False, scaler_adapts=False)  # warns: step 7 skipped
        >>> guard.consecutive
        1
        >>> guard.record(step=8, applied=True, scaler_adapts=False)
        >>> guard.consecutive
        0
    """

    def __init__(self, limit: int) -> None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"max_consecutive_nonfinite_steps must be an integer >= 1, got {limit!r}")
        self.limit = limit
        self.consecutive = 0

    def record(self, *, step: int, applied: bool, scaler_adapts: bool) -> None:
        """Account for one optimizer step.

        Args:
            step: the global step number of this step (``global_steps`` after it).
            applied: the update was applied (finite gradients).
            scaler_adapts: the loss scaler answers this overflow by lowering its scale (fp16
                dynamic scaling above ``min_loss_scale``).

        Raises:
            NonFiniteStepsError: this is the ``limit``-th non-finite step in a row.
        """
        if applied:
            self.consecutive = 0
            return
        if scaler_adapts:
            return
        self.consecutive += 1
        logger.warning(
            "step %d: the gradients are not finite (inf or NaN); the update was skipped and counted in "
            "skipped_steps (%d in a row, the limit is max_consecutive_nonfinite_steps=%d)",
            step,
            self.consecutive,
            self.limit,
        )
        if self.consecutive >= self.limit:
            raise NonFiniteStepsError(
                f"{self.consecutive} consecutive optimizer steps, the last at global step {step}, had non-finite "
                "gradients and were skipped (max_consecutive_nonfinite_steps="
                f"{self.limit}): training is not progressing. Look for inf/NaN in the loss and the inputs of "
                "these steps; lower the learning rate, enable gradient_clipping, or use bf16/fp32 instead of "
                'fp16; or raise "max_consecutive_nonfinite_steps" in the config to tolerate longer runs of them'
            )
