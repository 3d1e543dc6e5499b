"""``MonitorMaster``: fan events out to every enabled monitor, on rank 0 only.

Built once by ``initialize`` from the ``tensorboard``, ``csv_monitor``, ``wandb`` and
``comet`` sections and exposed as ``engine.monitor``. ``enabled`` is the same on every
rank (it says whether any section is on, which decides whether the engine gathers the
values to log), but only rank 0 constructs backends and writes, so a W&B run or a
TensorBoard file exists once per job.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from shardwise.config.model import ShardwiseConfig
from shardwise.config.resolve import ResolvedConfig
from shardwise.monitor.base import Event, Monitor, check_events


class MonitorMaster:
    """The monitors of one run.

    Args:
        monitors: the backends this rank writes to (empty on ranks other than 0).
        enabled: whether any monitor section is enabled (True on every rank when so).

    Example:
        >>> import tempfile
        >>> from shardwise.monitor.csv_monitor import CSVMonitor
        >>> master = MonitorMaster([CSVMonitor(tempfile.mkdtemp(), "job")], enabled=True)
        >>> master.write_events([("Custom/accuracy", 0.75, 64)])
        >>> master.close()
    """

    def __init__(self, monitors: Sequence[Monitor] = (), enabled: bool | None = None) -> None:
        self.monitors = list(monitors)
        self.enabled = bool(self.monitors) if enabled is None else enabled

    @property
    def writes(self) -> bool:
        """Whether this rank writes anything."""
        return bool(self.monitors)

    def write_events(self, events: Iterable[Event]) -> None:
        """Send ``(name, value, step)`` events to every monitor (no-op on other ranks).

        Events are validated on every rank, so a bad event fails the same way everywhere.
        ``step`` should be the global sample count (``engine.global_samples``), the axis
        the engine's own events use.

        Raises:
            ValueError: an event that is not ``(str, number, int)``.
        """
        checked = check_events(events)
        for monitor in self.monitors:
            monitor.write_events(checked)

    def flush(self) -> None:
        """Flush every monitor."""
        for monitor in self.monitors:
            monitor.flush()

    def close(self) -> None:
        """Close every monitor (files closed, runs finished); later events are dropped."""
        for monitor in self.monitors:
            monitor.close()
        self.monitors = []


def build_monitor(config: ResolvedConfig | ShardwiseConfig, rank: int) -> MonitorMaster:
    """The monitors a config enables, constructed on rank 0 only.

    Args:
        config: the resolved config (W&B records it as the run's config), or the typed
            ``ShardwiseConfig``.
        rank: this process's global rank.

    Raises:
        ConfigError: an enabled monitor's package is missing.

    Example:
        >>> from shardwise.config import load_config
        >>> cfg = load_config({"train_batch_size": 8, "csv_monitor": {"enabled": True,
        ...     "output_path": "/tmp/csv_runs", "job_name": "demo"}})
        >>> build_monitor(cfg.config, rank=1).enabled  # rank 1: enabled, writes nothing
        True
    """
    resolved = config if isinstance(config, ResolvedConfig) else None
    root = resolved.config if resolved is not None else config
    assert isinstance(root, ShardwiseConfig)
    sections = {name: getattr(root, name) for name in ("tensorboard", "csv_monitor", "wandb", "comet")}
    enabled = any(section.enabled for section in sections.values())
    if not enabled or rank != 0:
        return MonitorMaster([], enabled=enabled)
    monitors: list[Monitor] = []
    tb = sections["tensorboard"]
    if tb.enabled:
        from shardwise.monitor.tensorboard_monitor import TensorBoardMonitor

        monitors.append(TensorBoardMonitor(tb.output_path, tb.job_name))
    csv = sections["csv_monitor"]
    if csv.enabled:
        from shardwise.monitor.csv_monitor import CSVMonitor

        monitors.append(CSVMonitor(csv.output_path, csv.job_name))
    wb = sections["wandb"]
    if wb.enabled:
        from shardwise.monitor.wandb_monitor import WandbMonitor

        monitors.append(
            WandbMonitor(
                project=wb.project,
                group=wb.group,
                team=wb.team,
                run_config=resolved.to_ds_dict() if resolved is not None else None,  # the run's config
            )
        )
    comet = sections["comet"]
    if comet.enabled:
        from shardwise.monitor.comet_monitor import CometMonitor

        monitors.append(
            CometMonitor(
                samples_log_interval=comet.samples_log_interval,
                project=comet.project,
                workspace=comet.workspace,
                api_key=comet.api_key,
                experiment_name=comet.experiment_name,
                experiment_key=comet.experiment_key,
                online=comet.online,
                mode=comet.mode,
            )
        )
    return MonitorMaster(monitors, enabled=True)
