"""``tensorboard``: real event files through ``torch.utils.tensorboard``.

The writer's directory is ``<output_path>/<job_name>`` (``job_name`` alone, relative to
the working directory, when ``output_path`` is empty). Each event is one
``add_scalar(name, value, step)``; the writer is flushed after every batch of events,
so the files are readable while training runs.
"""

from __future__ import annotations

import os

from shardwise.monitor.base import Monitor, import_optional


class TensorBoardMonitor(Monitor):
    """Writes events to a TensorBoard ``SummaryWriter``.

    Args:
        output_path: base directory ("" = the working directory).
        job_name: subdirectory for this run.

    Raises:
        ConfigError: the ``tensorboard`` package is not installed.

    Example:
        >>> import tempfile
        >>> mon = TensorBoardMonitor(tempfile.mkdtemp(), "job")
        >>> mon.write_events([("Train/Samples/lr", 0.01, 8)])
        >>> mon.close()
    """

    name = "tensorboard"

    def __init__(self, output_path: str, job_name: str) -> None:
        import_optional("tensorboard", "tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = os.path.join(output_path, job_name) if output_path else job_name
        self.writer = SummaryWriter(log_dir=self.log_dir)

    def write_events(self, events: list[tuple[str, float, int]]) -> None:
        """One scalar per event, then flush."""
        for name, value, step in events:
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def flush(self) -> None:
        """Flush the event file."""
        self.writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self.writer.close()
