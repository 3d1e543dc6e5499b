"""``deepspeed.monitor.*``: DeepSpeed's monitor classes, built from a config section as DeepSpeed's are.

Each class takes its section (``ds_config.monitor_config.tensorboard``...), exposes the section's
settings as attributes (``enabled``, ``output_path``, ``job_name``...), and on rank 0 of an enabled
section writes through shardwise's backend (:mod:`shardwise.monitor`); other ranks and disabled
sections write nothing. ``write_events`` takes DeepSpeed's ``[(name, value, step), ...]``.
"""

from __future__ import annotations

from typing import Any

from shardwise.comm import get_rank, is_initialized
from shardwise.config.sections.base import Section
from shardwise.config.sections.observability import (
    CometConfig,
    CSVMonitorConfig,
    TensorBoardConfig,
    WandbConfig,
)
from shardwise.monitor.base import Monitor as _Backend
from shardwise.monitor.base import check_events
from shardwise.monitor.master import MonitorMaster

__all__ = ["CometMonitor", "DeepSpeedMonitorConfig", "Monitor", "MonitorMaster", "TensorBoardMonitor",
           "WandbMonitor", "csvMonitor"]


class DeepSpeedMonitorConfig(Section):
    """The four monitor sections together (DeepSpeed's ``ds_config.monitor_config``)."""

    tensorboard: TensorBoardConfig = TensorBoardConfig()
    wandb: WandbConfig = WandbConfig()
    csv_monitor: CSVMonitorConfig = CSVMonitorConfig()
    comet: CometConfig = CometConfig()

    @property
    def enabled(self) -> bool:
        """True when any monitor is enabled."""
        return any(s.enabled for s in (self.tensorboard, self.wandb, self.csv_monitor, self.comet))


def _writes() -> bool:
    return not is_initialized() or get_rank() == 0


class Monitor:
    """DeepSpeed's monitor base: the section's settings as attributes, a backend on the writing rank."""

    output_path: str
    job_name: str
    project: str
    group: str | None
    team: str | None

    def __init__(self, monitor_config: Any) -> None:
        self.monitor_config = monitor_config
        for name, value in monitor_config.model_dump().items():
            setattr(self, name, value)
        self.enabled: bool = monitor_config.enabled
        self.backend: _Backend | None = self._backend() if self.enabled and _writes() else None

    def _backend(self) -> _Backend:  # pragma: no cover - every subclass provides one
        raise NotImplementedError

    def write_events(self, event_list: list[tuple[str, Any, int]]) -> None:
        """Record ``(name, value, step)`` events (checked: a non-finite or non-numeric value raises)."""
        if self.backend is not None:
            self.backend.write_events(check_events(event_list))


class TensorBoardMonitor(Monitor):
    """``tensorboard``: event files under ``output_path/job_name``."""

    def _backend(self) -> _Backend:
        from shardwise.monitor.tensorboard_monitor import TensorBoardMonitor as Backend

        return Backend(self.output_path, self.job_name)


class csvMonitor(Monitor):
    """``csv_monitor``: one CSV file per event under ``output_path/job_name``."""

    def _backend(self) -> _Backend:
        from shardwise.monitor.csv_monitor import CSVMonitor as Backend

        return Backend(self.output_path, self.job_name)


class WandbMonitor(Monitor):
    """``wandb``: a Weights & Biases run."""

    def _backend(self) -> _Backend:
        from shardwise.monitor.wandb_monitor import WandbMonitor as Backend

        return Backend(self.project, self.group, self.team)


class CometMonitor(Monitor):
    """``comet``: a Comet experiment (``experiment`` is ``None`` off rank 0)."""

    def _backend(self) -> _Backend:
        from shardwise.monitor.comet_monitor import CometMonitor as Backend

        settings = self.monitor_config.model_dump()
        settings.pop("enabled")
        return Backend(**settings)

    @property
    def experiment(self) -> Any:
        """The Comet experiment, or ``None`` where this rank writes nothing."""
        return getattr(self.backend, "experiment", None)
