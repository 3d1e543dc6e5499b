"""``wandb``: a Weights & Biases run, on rank 0 only.

``wandb.init(project=..., group=..., entity=team, config=...)``, then one
``run.log({...}, step=...)`` per distinct step in a batch of events. The run's config is
the resolved DeepSpeed config (every key, ``"auto"`` resolved), so runs can be compared
by ZeRO stage, precision or batch size in the W&B table. Offline runs need no account: set
``WANDB_MODE=offline`` (and optionally ``WANDB_DIR``) in the environment, and the run is
written under ``wandb/offline-run-*`` for a later ``wandb sync``. (wandb 0.31 finishes
writing that file when its background service stops, at process exit or on
``wandb.teardown()``, not when ``finish()`` returns.) The ``wandb`` package is imported
only when the section is enabled.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardwise.monitor.base import Monitor, import_optional


class WandbMonitor(Monitor):
    """Logs events to a W&B run.

    Args:
        project: W&B project (DeepSpeed's default ``"deepspeed"``).
        group: run group, or None.
        team: W&B entity (team or user), or None for the default.
        run_config: recorded as the run's config (the resolved training config), or None.

    Raises:
        ConfigError: the ``wandb`` package is not installed.

    Example:
        >>> # with WANDB_MODE=offline in the environment:
        >>> # mon = WandbMonitor(project="demo", group=None, team=None)
        >>> # mon.write_events([("Train/Samples/lr", 0.01, 8)])
    """

    name = "wandb"

    def __init__(
        self, project: str, group: str | None, team: str | None, run_config: Mapping[str, object] | None = None
    ) -> None:
        wandb = import_optional("wandb", "wandb", "wandb")
        self.run: Any = wandb.init(project=project, group=group, entity=team, config=run_config)

    def write_events(self, events: list[tuple[str, float, int]]) -> None:
        """Log the events, one ``log`` call per step (W&B rows are keyed by step)."""
        by_step: dict[int, dict[str, float]] = {}
        for name, value, step in events:
            by_step.setdefault(step, {})[name] = value
        for step, values in by_step.items():
            self.run.log(values, step=step)

    def close(self) -> None:
        """Finish the run (writes its summary; offline runs are complete on disk)."""
        self.run.finish()
