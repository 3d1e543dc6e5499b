"""The analyzer's index files: how they are named, written and read.

For a metric ``m`` the analyzer writes, under ``<save_path>/<m>/``:

- ``m_sample_to_metric.npy``: the metric value of every sample (``[num_samples]``);
- ``m_index_to_metric.npy``: the distinct values, ascending (``[rows]``);
- ``m_index_to_sample.npz``: for each row, the ids of the samples with that value (ragged
  rows stored as ``samples`` plus ``offsets``, row ``i`` is ``samples[offsets[i]:offsets[i+1]]``);
- ``m_index_to_sample_percentile_merged.npz``: the same samples in the same order, rows merged
  so that each holds about one percent of the dataset (the smaller file for percentile metrics).

A config names them by path, with or without the extension (DeepSpeed names its mmap files by
prefix). The format is numpy's own rather than DeepSpeed's ``.bin``/``.idx`` pair: no
indexed-dataset reader is needed, and the files are small and portable.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from shardwise.config.errors import ConfigError

__all__ = ["RaggedIndex", "index_paths", "read_index_to_metric", "read_index_to_sample", "write_index"]


class RaggedIndex:
    """Rows of sample ids (``index_to_sample``).

    Attributes:
        samples: every id, row after row.
        offsets: row ``i`` is ``samples[offsets[i]:offsets[i + 1]]``.
    """

    def __init__(self, samples: np.ndarray, offsets: np.ndarray) -> None:
        self.samples = samples
        self.offsets = offsets

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def row(self, i: int) -> np.ndarray:
        """The ids of row ``i``."""
        return self.samples[self.offsets[i] : self.offsets[i + 1]]

    @classmethod
    def from_rows(cls, rows: list[np.ndarray]) -> RaggedIndex:
        """Build from a list of id arrays."""
        sizes = np.array([len(r) for r in rows], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        samples = np.concatenate(rows).astype(np.int64) if rows else np.zeros(0, dtype=np.int64)
        return cls(samples, offsets)


def index_paths(save_path: str | os.PathLike[str], metric: str) -> dict[str, Path]:
    """The files the analyzer writes for ``metric`` (keys: sample_to_metric, index_to_metric,
    index_to_sample, index_to_sample_percentile_merged)."""
    base = Path(save_path) / metric
    return {
        "sample_to_metric": base / f"{metric}_sample_to_metric.npy",
        "index_to_metric": base / f"{metric}_index_to_metric.npy",
        "index_to_sample": base / f"{metric}_index_to_sample.npz",
        "index_to_sample_percentile_merged": base / f"{metric}_index_to_sample_percentile_merged.npz",
    }


def write_index(path: Path, index: RaggedIndex) -> None:
    """Write ``index`` to ``path`` (``.npz``), atomically."""
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, samples=index.samples, offsets=index.offsets)
    os.replace(tmp, path)


def _resolve(path: str, ext: str, key: str) -> Path:
    for candidate in (Path(path), Path(path + ext)):
        if candidate.is_file():
            return candidate
    raise ConfigError(
        key,
        f"names no file (looked for {path} and {path}{ext})",
        "run shardwise.data_efficiency.DataAnalyzer on the dataset first, and give the path it wrote",
        value=path,
    )


def read_index_to_sample(path: str, key: str) -> RaggedIndex:
    """Read an ``index_to_sample`` file; ``key`` names the config key in the error.

    Raises:
        ConfigError: the file does not exist.
    """
    with np.load(_resolve(path, ".npz", key)) as data:
        return RaggedIndex(data["samples"], data["offsets"])


def read_index_to_metric(path: str, key: str) -> np.ndarray:
    """Read an ``index_to_metric`` file (see :func:`read_index_to_sample`)."""
    return np.load(_resolve(path, ".npy", key))
