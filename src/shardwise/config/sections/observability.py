"""Monitors, comms logger, flops profiler and timers (spec 3.10, 3.14, 3.15)."""

from __future__ import annotations

from pydantic import Field

from shardwise.config.sections.base import Section


class TensorBoardConfig(Section):
    """``tensorboard``: event files under ``output_path/job_name``."""

    enabled: bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"


class CSVMonitorConfig(Section):
    """``csv_monitor``: one CSV file per event under ``output_path/job_name``."""

    enabled: bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"


class WandbConfig(Section):
    """``wandb``: Weights & Biases run (works offline)."""

    enabled: bool = False
    group: str | None = None
    team: str | None = None
    project: str = "deepspeed"


class CometConfig(Section):
    """``comet``: Comet experiment."""

    enabled: bool = False
    samples_log_interval: int = Field(100, gt=0)
    project: str | None = None
    workspace: str | None = None
    api_key: str | None = None
    experiment_name: str | None = None
    experiment_key: str | None = None
    online: bool | None = None
    mode: str | None = None


class CommsLoggerConfig(Section):
    """``comms_logger``: record every collective."""

    enabled: bool = False
    verbose: bool = False
    prof_all: bool = True
    debug: bool = False
    prof_ops: list[str] = Field(default_factory=list)


class FlopsProfilerConfig(Section):
    """``flops_profiler``: per-module FLOPs/latency table at ``profile_step``."""

    enabled: bool = False
    recompute_fwd_factor: float = Field(0.0, ge=0)
    profile_step: int = 1  # -1 (seen in real files) means never
    module_depth: int = -1
    top_modules: int = Field(1, ge=0)
    detailed: bool = True
    output_file: str | None = None


class ThroughputTimerConfig(Section):
    """``timers.throughput``."""

    enabled: bool = True
    synchronized: bool = True


class TimersConfig(Section):
    """``timers``."""

    throughput: ThroughputTimerConfig = Field(default_factory=ThroughputTimerConfig)
