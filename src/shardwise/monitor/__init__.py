"""Monitors: TensorBoard, CSV, Weights & Biases and Comet, one small module each.

``initialize`` builds a :class:`MonitorMaster` from the config and the engine exposes it
as ``engine.monitor``; user code adds its own scalars with
``engine.monitor.write_events([(name, value, engine.global_samples)])``. Optional
packages (``tensorboard``, ``wandb``, ``comet_ml``) are imported only by the backend
that needs them, when its section is enabled.

Example:
    >>> from shardwise.monitor import MonitorMaster
    >>> MonitorMaster().enabled
    False
"""

from __future__ import annotations

from shardwise.monitor.base import Event, Monitor, check_events, import_optional
from shardwise.monitor.master import MonitorMaster, build_monitor

__all__ = ["Event", "Monitor", "MonitorMaster", "build_monitor", "check_events", "import_optional"]
