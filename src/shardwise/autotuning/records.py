"""Experiments on disk: what was tried, how it ended, and what it measured.

Layout (as DeepSpeed's autotuner): ``exps_dir/<name>.json`` describes an experiment (its
settings and ds_config); ``results_dir/<name>/`` holds its ``ds_config.json``, ``metrics.json``
(written by the experiment), ``stdout.log``, ``stderr.log`` and ``result.json`` (the record).
With ``overwrite: false`` a finished record is read back instead of launching again, so an
interrupted tuning resumes where it stopped.

Example:
    >>> import tempfile
    >>> store = ExperimentStore(tempfile.mkdtemp(), tempfile.mkdtemp())
    >>> store.save(Record("z1_mbs2_gas1", "ok", metric=12.5))
    >>> store.finished("z1_mbs2_gas1").metric
    12.5
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from shardwise.autotuning.metric_hook import write_json_atomically

__all__ = ["FINISHED", "ExperimentStore", "Record"]

OK, FAILED, OOM, TIMEOUT, PRUNED, INVALID = "ok", "failed", "oom", "timeout", "pruned", "invalid"
FINISHED = frozenset({OK, FAILED, OOM, TIMEOUT})
"""Statuses of an experiment that ran to an outcome (resumed as they are with ``overwrite: false``)."""


@dataclass
class Record:
    """One experiment's outcome.

    Attributes:
        name: the experiment's name (a file-safe string).
        status: ``ok``, ``failed``, ``oom``, ``timeout``, ``pruned`` (the plan says it cannot fit)
            or ``invalid`` (its config does not validate).
        metric: the chosen metric's value (``ok`` only).
        metrics: everything the experiment measured.
        settings: the candidate's settings.
        predicted_bytes: the memory plan's bytes per rank.
        error: why it failed or was pruned.
        seconds: wall time of the launch.
    """

    name: str
    status: str
    metric: float | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)
    predicted_bytes: int | None = None
    error: str = ""
    seconds: float = 0.0

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Record:
        """The record a ``result.json`` holds."""
        known = set(cls.__dataclass_fields__)
        return cls(**{key: value for key, value in data.items() if key in known})


class ExperimentStore:
    """The experiment and result folders of one tuning.

    Args:
        exps_dir: where experiment descriptions go.
        results_dir: where each experiment's folder and the tuning's summary go.
    """

    def __init__(self, exps_dir: str, results_dir: str) -> None:
        self.exps_dir = exps_dir
        self.results_dir = results_dir

    def folder(self, name: str) -> str:
        """``results_dir/<name>``, created."""
        path = os.path.join(self.results_dir, name)
        os.makedirs(path, exist_ok=True)
        return path

    def describe(self, name: str, settings: Mapping[str, object], ds_config: Mapping[str, object]) -> str:
        """Write the experiment's description and its ds_config; returns the ds_config's path."""
        write_json_atomically(
            os.path.join(self.exps_dir, f"{name}.json"),
            {"name": name, "settings": dict(settings), "ds_config": dict(ds_config)},
        )
        path = os.path.join(self.folder(name), "ds_config.json")
        write_json_atomically(path, ds_config)
        return path

    def save(self, record: Record) -> None:
        """Write ``result.json``."""
        write_json_atomically(os.path.join(self.folder(record.name), "result.json"), asdict(record))

    def finished(self, name: str) -> Record | None:
        """The record of an experiment that already ran to an outcome, else None."""
        path = os.path.join(self.results_dir, name, "result.json")
        if not os.path.isfile(path):
            return None
        try:
            with open(path, encoding="utf-8") as handle:
                record = Record.from_dict(json.load(handle))
        except (OSError, ValueError, TypeError):
            return None  # a torn or foreign file: run the experiment again
        return record if record.status in FINISHED else None
