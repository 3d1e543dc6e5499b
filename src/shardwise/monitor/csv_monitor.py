"""``csv_monitor``: one CSV file per event, DeepSpeed's layout (spec 11.3, verified).

Files live in ``<output_path>/<job_name>/`` (relative to the working directory when
``output_path`` is empty). A file is named after the event with ``/`` and spaces turned
into ``_`` plus ``.csv`` (``Train/Samples/lr`` -> ``Train_Samples_lr.csv``). It is
opened in append mode; the first time this process writes to it, the header
``step,<last component of the name>`` is written (so a restarted run appends a new
header, as DeepSpeed does); then one ``<step>,<value>`` row per event.
"""

from __future__ import annotations

import csv
import os
from typing import IO, Any

from shardwise.monitor.base import Monitor


def csv_file_name(event_name: str) -> str:
    """The file an event goes to.

    Example:
        >>> csv_file_name("Train/Samples/elapsed_time_ms_forward")
        'Train_Samples_elapsed_time_ms_forward.csv'
    """
    return event_name.replace("/", "_").replace(" ", "_") + ".csv"


class CSVMonitor(Monitor):
    """Writes events as CSV files.

    Args:
        output_path: base directory ("" = the working directory).
        job_name: subdirectory for this run.

    Example:
        >>> import tempfile
        >>> mon = CSVMonitor(tempfile.mkdtemp(), "job")
        >>> mon.write_events([("Train/Samples/lr", 0.01, 8)])
        >>> mon.close()
    """

    name = "csv_monitor"

    def __init__(self, output_path: str, job_name: str) -> None:
        self.log_dir = os.path.join(output_path, job_name) if output_path else job_name
        os.makedirs(self.log_dir, exist_ok=True)
        self._files: dict[str, tuple[IO[str], object]] = {}

    def _writer(self, event_name: str) -> Any:
        entry = self._files.get(event_name)
        if entry is None:
            handle = open(os.path.join(self.log_dir, csv_file_name(event_name)), "a", newline="")  # noqa: SIM115 - kept open across steps, closed in close()
            writer = csv.writer(handle)
            writer.writerow(["step", event_name.split("/")[-1]])
            entry = (handle, writer)
            self._files[event_name] = entry
        return entry[1]

    def write_events(self, events: list[tuple[str, float, int]]) -> None:
        """Append one row per event, then flush the touched files."""
        touched = set()
        for name, value, step in events:
            self._writer(name).writerow([step, value])
            touched.add(name)
        for name in touched:
            self._files[name][0].flush()

    def flush(self) -> None:
        """Flush every open file."""
        for handle, _ in self._files.values():
            handle.flush()

    def close(self) -> None:
        """Close every file."""
        for handle, _ in self._files.values():
            handle.close()
        self._files = {}
