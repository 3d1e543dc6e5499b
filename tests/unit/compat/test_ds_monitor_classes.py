"""deepspeed.monitor.*: DeepSpeed's monitor classes built from their config sections."""

from __future__ import annotations

from pathlib import Path

from shardwise.compat.monitors import DeepSpeedMonitorConfig, TensorBoardMonitor, WandbMonitor, csvMonitor
from shardwise.config.sections.observability import CSVMonitorConfig, TensorBoardConfig


def test_defaults_and_settings_as_attributes() -> None:
    defaults = DeepSpeedMonitorConfig()
    assert not defaults.enabled
    monitor = TensorBoardMonitor(defaults.tensorboard)
    assert (monitor.enabled, monitor.output_path, monitor.job_name) == (False, "", "DeepSpeedJobName")
    assert monitor.backend is None
    monitor.write_events([("Train/loss", 1.0, 1)])  # disabled: writes nothing
    assert WandbMonitor(defaults.wandb).project == "deepspeed"


def test_enabled_csv_monitor_writes(tmp_path: Path) -> None:
    monitor = csvMonitor(CSVMonitorConfig(enabled=True, output_path=str(tmp_path), job_name="job"))
    monitor.write_events([("Train/Samples/loss", 0.5, 8)])
    monitor.backend.close()
    (written,) = (tmp_path / "job").iterdir()
    assert written.read_text().splitlines() == ["step,loss", "8,0.5"]
    assert DeepSpeedMonitorConfig(tensorboard=TensorBoardConfig(enabled=True)).enabled
