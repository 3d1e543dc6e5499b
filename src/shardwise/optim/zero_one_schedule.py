"""When 0/1 Adam (DeepSpeed's ``ZeroOneAdam``) updates its variance and when it synchronises.

Pure functions of the step number ``t`` (1 for the first update), so the phase needs no state
of its own and a resumed run continues it exactly.

- **variance steps** (``t <= var_freeze_step``): the interval between variance updates starts at
  1 and doubles after every ``var_update_scaler`` updates (the kappa of the 0/1 Adam paper):
  with ``var_update_scaler=2`` the variance steps are 1, 2, 4, 6, 8, 12, 16, 24, ...; a step is a
  variance step when ``t`` is a multiple of the interval in force.
- **local steps** (``t > var_freeze_step``): parameters synchronise at the steps ``t`` that are a
  multiple of the local-step interval; it starts at 1 and doubles every ``local_step_scaler``
  steps after the freeze, capped at ``local_step_clipper`` (the H of the paper).

Example:
    >>> [t for t in range(1, 25) if is_variance_step(t, 2)]
    [1, 2, 4, 6, 8, 12, 16, 24]
    >>> [local_step_interval(t, var_freeze_step=4, scaler=2, clipper=4) for t in range(5, 13)]
    [1, 1, 2, 2, 4, 4, 4, 4]
"""

from __future__ import annotations

__all__ = ["is_sync_step", "is_variance_step", "local_step_interval"]


def is_variance_step(t: int, scaler: int) -> bool:
    """Whether step ``t`` (>= 1) updates the variance (with full-precision gradients)."""
    interval, last = 1, 0  # the interval in force after step `last`
    while True:
        # the `scaler` variance steps at this interval: the multiples of it after `last`
        first = (last // interval + 1) * interval
        end = first + (scaler - 1) * interval
        if t <= end:
            return t >= first and t % interval == 0
        interval, last = interval * 2, end


def local_step_interval(t: int, *, var_freeze_step: int, scaler: int, clipper: int) -> int:
    """Steps between synchronisations in force at step ``t > var_freeze_step``."""
    doublings = (t - var_freeze_step - 1) // scaler
    if doublings >= clipper.bit_length():
        return clipper
    return min(clipper, 1 << doublings)


def is_sync_step(t: int, *, var_freeze_step: int, scaler: int, clipper: int) -> bool:
    """Whether step ``t > var_freeze_step`` ends with a (1-bit) parameter synchronisation."""
    interval = local_step_interval(t, var_freeze_step=var_freeze_step, scaler=scaler, clipper=clipper)
    return t % interval == 0
