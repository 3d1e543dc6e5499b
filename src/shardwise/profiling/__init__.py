"""Profiling and telemetry: wall-clock timers, the flops profiler, memory reports, progress lines.

Names load on first use (like :mod:`shardwise.comm`), so importing the package costs
nothing until a profiler is needed.

Example:
    >>> from shardwise.profiling import get_model_profile
    >>> import torch
    >>> get_model_profile(torch.nn.Linear(4, 4), input_shape=(2, 4), print_profile=False, as_string=False)
    (64, 32, 20)
"""

from __future__ import annotations

from shardwise.utils.lazy import lazy_exports

_LAZY: dict[str, tuple[str, str]] = {
    "FlopsProfiler": ("shardwise.profiling.flops_profiler", "FlopsProfiler"),
    "get_model_profile": ("shardwise.profiling.flops_profiler", "get_model_profile"),
    "see_memory_usage": ("shardwise.profiling.memory", "see_memory_usage"),
    "memory_report": ("shardwise.profiling.memory", "memory_report"),
    "WallClockTimers": ("shardwise.profiling.timers", "WallClockTimers"),
    "ThroughputTimer": ("shardwise.profiling.timers", "ThroughputTimer"),
    "Telemetry": ("shardwise.profiling.telemetry", "Telemetry"),
    "build_telemetry": ("shardwise.profiling.telemetry", "build_telemetry"),
    "report_logger": ("shardwise.utils.report", "report_logger"),
}

__all__ = sorted(_LAZY)


__getattr__, __dir__ = lazy_exports("shardwise.profiling", _LAZY, globals())
