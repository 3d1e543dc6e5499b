"""``comet``: a Comet experiment, on rank 0 only.

The experiment is started with ``comet_ml.start`` from the section's ``api_key``,
``workspace``, ``project``, ``experiment_key``, ``mode`` and ``online`` (``online: false``
writes an offline archive, no account needed) and named ``experiment_name``. Each event
becomes ``log_metric(name, value, step=step)``, but no more often than every
``samples_log_interval`` samples per event name (the step axis is samples), so a long
run does not flood the service. The ``comet_ml`` package is imported only when the
section is enabled.
"""

from __future__ import annotations

import inspect
from typing import Any

from shardwise.monitor.base import Monitor, import_optional


class CometMonitor(Monitor):
    """Logs events to a Comet experiment.

    Args:
        samples_log_interval: minimum distance in samples between two logged values of
            the same event.
        project, workspace, api_key, experiment_name, experiment_key, online, mode: passed
            to ``comet_ml.start`` (None leaves Comet's own default or environment setting).

    Raises:
        ConfigError: the ``comet_ml`` package is not installed.

    Example:
        >>> # mon = CometMonitor(samples_log_interval=100, online=False)
        >>> # mon.write_events([("Train/Samples/train_loss", 2.3, 800)])
    """

    name = "comet"

    def __init__(
        self,
        samples_log_interval: int = 100,
        project: str | None = None,
        workspace: str | None = None,
        api_key: str | None = None,
        experiment_name: str | None = None,
        experiment_key: str | None = None,
        online: bool | None = None,
        mode: str | None = None,
    ) -> None:
        comet_ml = import_optional("comet_ml", "comet", "comet_ml")
        self.samples_log_interval = samples_log_interval
        kwargs: dict[str, Any] = {
            "api_key": api_key,
            "workspace": workspace,
            "experiment_key": experiment_key,
            "mode": mode,
            "online": online,
        }
        # newer comet_ml spells the project ``project_name`` and deprecates ``project``
        accepted = inspect.signature(comet_ml.start).parameters
        kwargs["project_name" if "project_name" in accepted else "project"] = project
        if experiment_name is not None:
            kwargs["experiment_config"] = comet_ml.ExperimentConfig(name=experiment_name)
        self.experiment: Any = comet_ml.start(**kwargs)
        self._last_logged: dict[str, int] = {}

    def _due(self, name: str, step: int) -> bool:
        last = self._last_logged.get(name)
        return last is None or step - last >= self.samples_log_interval

    def write_events(self, events: list[tuple[str, float, int]]) -> None:
        """Log each event whose name was last logged at least ``samples_log_interval`` samples ago."""
        for name, value, step in events:
            if self._due(name, step):
                self.experiment.log_metric(name, value, step=step)
                self._last_logged[name] = step

    def close(self) -> None:
        """End the experiment (uploads or finishes the offline archive)."""
        self.experiment.end()
