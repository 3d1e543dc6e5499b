"""Wall-clock timers for the phases of a training step, and the throughput timer.

``wall_clock_breakdown`` (spec 11.2) times five phases of every micro step: forward,
backward, its two parts (``bwd_inner``: autograd, ``bwd_allreduce``: waiting for the
gradient reduction that backward hooks launched), and ``step``. Each phase has a micro
timer (the last micro step, ``fwd_microstep``...) and a window timer summed over the
gradient-accumulation window (``fwd``...), DeepSpeed's ten names.

With ``overlap_comm`` most of the reduction runs inside ``bwd_inner`` (hooks launch it
while autograd continues), so ``bwd_allreduce`` is only the part of the reduction that
backward did not hide: the number that says whether communication costs step time.

On CUDA each phase boundary synchronises the device, so a phase is charged for its own
kernels; that costs overlap, which is why the timers are off unless asked for. On CPU no
synchronisation is needed.

The throughput timer (``timers.throughput``, on unless disabled there, and running
only when something reports it: ``steps_per_print`` or a monitor) measures samples per
second over each optimizer step, from the first forward of the accumulation window to
the end of the boundary ``step()``. Data loading before the window's first forward is
not charged; loading between its micro batches is. DeepSpeed sums each micro step's
forward-to-step time instead, which needs a device synchronisation per micro step; this
needs two per optimizer step, so the CPU can keep queueing work across micro steps. The
first ``start_step`` (2) optimizer steps, which include warm-up and allocation, are left
out of the running average.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from types import TracebackType

import torch

FORWARD = "fwd"
BACKWARD = "bwd"
BACKWARD_INNER = "bwd_inner"
BACKWARD_REDUCE = "bwd_allreduce"
STEP = "step"
PHASES: tuple[str, ...] = (FORWARD, BACKWARD, BACKWARD_INNER, BACKWARD_REDUCE, STEP)
MICRO_SUFFIX = "_microstep"

# Event names of the window timers for monitors (spec 11.3).
MONITOR_NAMES: dict[str, str] = {
    FORWARD: "Train/Samples/elapsed_time_ms_forward",
    BACKWARD: "Train/Samples/elapsed_time_ms_backward",
    BACKWARD_INNER: "Train/Samples/elapsed_time_ms_backward_inner",
    BACKWARD_REDUCE: "Train/Samples/elapsed_time_ms_backward_allreduce",
    STEP: "Train/Samples/elapsed_time_ms_step",
}

_NULL = contextlib.nullcontext()


def _device_sync(device: torch.device | None) -> Callable[[], None] | None:
    """A function that waits for the device's queued work, or None where nothing is queued."""
    if device is None or device.type == "cpu":
        return None
    module = getattr(torch, device.type, None)
    sync = getattr(module, "synchronize", None)
    if sync is None:
        return None
    return lambda: sync(device)


class _PhaseTimer:
    """Times one phase: a reusable context manager that adds to the micro and window totals."""

    __slots__ = ("_clock", "_owner", "_start", "name")

    def __init__(self, owner: WallClockTimers, name: str, clock: Callable[[], float]) -> None:
        self._owner = owner
        self.name = name
        self._clock = clock
        self._start: float | None = None

    def __enter__(self) -> None:
        if self._owner._sync is not None:
            self._owner._sync()
        self._start = self._clock()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._owner._sync is not None:
            self._owner._sync()
        assert self._start is not None, "phase timer exited without entering"
        elapsed_ms = (self._clock() - self._start) * 1000.0
        self._start = None
        self._owner._add(self.name, elapsed_ms)


class WallClockTimers:
    """The ten wall-clock timers of ``wall_clock_breakdown``.

    Args:
        enabled: False makes :meth:`phase` return a shared null context (no cost).
        device: the training device; CUDA and other accelerators are synchronised at
            phase boundaries.
        clock: seconds, monotonic (injectable for tests).

    Example:
        >>> timers = WallClockTimers(enabled=True)
        >>> with timers.phase(FORWARD):
        ...     pass
        >>> window = timers.end_window()
        >>> sorted(window) == sorted(PHASES)
        True
    """

    def __init__(
        self,
        enabled: bool,
        device: torch.device | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.enabled = enabled
        self._sync = _device_sync(device)
        self._timers = {name: _PhaseTimer(self, name, clock) for name in PHASES}
        self._micro: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self._window: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self._last_window: dict[str, float] = dict.fromkeys(PHASES, 0.0)

    def phase(self, name: str) -> AbstractContextManager[None]:
        """A context manager timing phase ``name`` (one of :data:`PHASES`)."""
        if not self.enabled:
            return _NULL
        return self._timers[name]

    def _add(self, name: str, elapsed_ms: float) -> None:
        self._micro[name] = elapsed_ms
        self._window[name] += elapsed_ms

    def end_window(self) -> dict[str, float]:
        """Close the accumulation window: return its totals (ms) and start a new one."""
        self._last_window = self._window
        self._window = dict.fromkeys(PHASES, 0.0)
        return dict(self._last_window)

    def as_dict(self) -> dict[str, float]:
        """DeepSpeed's ``get_wall_clock_timers()``: the last micro step and window, in ms.

        Empty when the timers are off.
        """
        if not self.enabled:
            return {}
        out = {name + MICRO_SUFFIX: value for name, value in self._micro.items()}
        out.update(self._last_window)
        return out


class ThroughputTimer:
    """Samples per second over optimizer steps (``timers.throughput``).

    Args:
        enabled: False turns it off (no clock reads).
        batch_size: samples per optimizer step over all ranks (``train_batch_size``).
        start_step: optimizer steps left out of the running average (warm-up).
        device: synchronised before reading the clock when ``synchronized``.
        synchronized: wait for the device so queued kernels are counted.
        clock: seconds, monotonic (injectable for tests).

    Example:
        >>> ticks = iter([0.0, 0.5])
        >>> timer = ThroughputTimer(True, batch_size=8, start_step=0, clock=lambda: next(ticks))
        >>> timer.start(); timer.stop(boundary=True)
        >>> timer.current_samples_per_sec
        16.0
    """

    def __init__(
        self,
        enabled: bool,
        batch_size: int,
        start_step: int = 2,
        device: torch.device | None = None,
        synchronized: bool = True,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.enabled = enabled
        self.batch_size = batch_size
        self.start_step = start_step
        self._sync = _device_sync(device) if synchronized else None
        self._clock = clock
        self._started: float | None = None
        self._total_s = 0.0
        self._steps = 0  # optimizer steps seen
        self._counted = 0  # steps inside the running average
        self.current_samples_per_sec: float | None = None

    def start(self) -> None:
        """A forward begins; the first one of a window starts the clock."""
        if not self.enabled or self._started is not None:
            return
        if self._sync is not None:
            self._sync()
        self._started = self._clock()

    def stop(self, boundary: bool) -> None:
        """``step()`` ended; at a boundary the window's rate is computed and the clock stops."""
        if not self.enabled or not boundary or self._started is None:
            return
        if self._sync is not None:
            self._sync()
        elapsed = self._clock() - self._started
        self._started = None
        self._steps += 1
        if elapsed > 0:
            self.current_samples_per_sec = self.batch_size / elapsed
        if self._steps > self.start_step:
            self._total_s += elapsed
            self._counted += 1

    @property
    def avg_samples_per_sec(self) -> float | None:
        """Running average over the steps after ``start_step`` (None before any)."""
        if self._counted == 0 or self._total_s <= 0:
            return None
        return self.batch_size * self._counted / self._total_s
