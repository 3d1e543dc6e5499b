"""Named wall-clock timers a script starts and stops itself: DeepSpeed's (and Megatron's)
``SynchronizedWallClockTimer`` (``deepspeed.utils.timer``; ``deepspeed.comm.timers`` is one), and
``NoopTimer``, the same interface doing nothing.

``timers("fwd").start()`` ... ``timers("fwd").stop()`` adds one interval to the timer ``fwd``;
``elapsed()`` is the sum of its intervals in ms (and resets them unless ``reset=False``), ``mean()`` their
trimmed mean (DeepSpeed's ``trim_mean``, 10 %). On an accelerator the device is synchronised at
``start`` and ``stop``, so an interval covers the kernels queued inside it (DeepSpeed records device
events instead; both count the same work). ``log`` writes ``time (ms) | name: value ...`` through the
report logger on the ranks asked for (rank 0 by default).

Example:
    >>> timers = SynchronizedWallClockTimer()
    >>> timers("step").start(); timers("step").stop()
    >>> timers("step").elapsed() >= 0.0, list(timers.get_timers())
    (True, ['step'])
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from shardwise.comm.comms_logger import trimmed_mean
from shardwise.utils.logging import dist_message
from shardwise.utils.report import report_logger

__all__ = ["NoopTimer", "SynchronizedWallClockTimer"]


def _device_sync() -> Callable[[], None] | None:
    return torch.cuda.synchronize if torch.cuda.is_available() and torch.cuda.is_initialized() else None


class _Timer:
    """One named timer: intervals between ``start`` and ``stop``, in seconds."""

    def __init__(self, name: str) -> None:
        self.name_ = name
        self.started_ = False
        self.start_time = 0.0
        self.intervals: list[float] = []
        self.elapsed_records: list[float] | None = None

    def start(self) -> None:
        """Start an interval (the timer must be stopped)."""
        assert not self.started_, f"{self.name_} timer has already been started"
        sync = _device_sync()
        if sync is not None:
            sync()
        self.start_time = time.perf_counter()
        self.started_ = True

    def stop(self, reset: bool = False, record: bool = False) -> None:
        """End the interval (``reset``/``record``: DeepSpeed's arguments, which change nothing there either)."""
        assert self.started_, "timer is not started"
        sync = _device_sync()
        if sync is not None:
            sync()
        self.intervals.append(time.perf_counter() - self.start_time)
        self.started_ = False

    def reset(self) -> None:
        """Forget every interval and stop."""
        self.started_ = False
        self.elapsed_records = None
        self.intervals.clear()

    def elapsed(self, reset: bool = True) -> float:
        """The intervals' sum in ms (a running interval is ended, counted and restarted)."""
        running = self.started_
        if running:
            self.stop()
        self.elapsed_records = [seconds * 1000.0 for seconds in self.intervals]
        total = sum(self.elapsed_records)
        if reset:
            self.reset()
        if running:
            self.start()
        return total

    def mean(self) -> float:
        """The trimmed mean of the intervals, in ms (they are kept)."""
        self.elapsed(reset=False)
        return trimmed_mean(self.elapsed_records or [], 0.1)


class SynchronizedWallClockTimer:
    """A group of named timers, made on first use: ``timers(name)``."""

    Timer = _Timer

    def __init__(self) -> None:
        self.timers: dict[str, _Timer] = {}

    def get_timers(self) -> dict[str, _Timer]:
        """Every timer made so far, by name."""
        return self.timers

    def __call__(self, name: str) -> _Timer:
        if name not in self.timers:
            self.timers[name] = _Timer(name)
        return self.timers[name]

    def log(self, names: Sequence[str], normalizer: float = 1.0, reset: bool = True, memory_breakdown: bool = False,
            ranks: Sequence[int] | None = None) -> None:
        """Log ``time (ms) | name: elapsed / normalizer`` for the named timers that exist, on ``ranks`` (default
        rank 0); ``memory_breakdown`` is DeepSpeed's argument, which it does not use either."""
        assert normalizer > 0.0
        text = "time (ms)" + "".join(
            f" | {name}: {self.timers[name].elapsed(reset=reset) / normalizer:.2f}" for name in names if name in self.timers
        )
        message = dist_message(text, ranks or [0])
        if message is not None:
            report_logger().info(message, extra={"all_ranks": True})

    def get_mean(self, names: Sequence[str], normalizer: float = 1.0, reset: bool = True) -> dict[str, float]:
        """``{name: mean * 1000 / normalizer}`` for the named timers that exist (DeepSpeed's scale: the trimmed
        mean in ms, times 1000)."""
        assert normalizer > 0.0
        return {name: self.timers[name].mean() * 1000.0 / normalizer for name in names if name in self.timers}


class _NoopTimerEntry:
    def start(self) -> None:
        """Nothing."""

    def reset(self) -> None:
        """Nothing."""

    def stop(self, **kwargs: Any) -> None:
        """Nothing."""

    def elapsed(self, **kwargs: Any) -> float:
        """Always 0."""
        return 0

    def mean(self) -> float:
        """Always 0."""
        return 0


class NoopTimer:
    """:class:`SynchronizedWallClockTimer`'s interface, timing nothing (timers switched off)."""

    Timer = _NoopTimerEntry

    def __init__(self) -> None:
        self.timer = _NoopTimerEntry()

    def __call__(self, name: str) -> _NoopTimerEntry:
        return self.timer

    def get_timers(self) -> dict[str, Any]:
        """Always empty."""
        return {}

    def log(self, names: Sequence[str], normalizer: float = 1.0, reset: bool = True, memory_breakdown: bool = False,
            ranks: Sequence[int] | None = None) -> None:
        """Nothing."""

    def get_mean(self, names: Sequence[str], normalizer: float = 1.0, reset: bool = True) -> None:
        """Nothing (None)."""
