"""The offline data analyzer: per-sample metric values, then the index files the curriculum
sampler reads (``data_sampling.curriculum_learning.curriculum_metrics.<m>.index_to_*_path``).

It is a map/reduce like DeepSpeed's ``DataAnalyzer``:

- **map** (:meth:`DataAnalyzer.run_map`): worker ``worker_id`` of ``num_workers`` (one per rank,
  or per machine, or per job: they share nothing but ``save_path``) computes its contiguous share
  of the dataset, ``num_threads`` threads at a time, ``batch_size`` samples per call of each
  metric function, and saves each batch's values to its own file as soon as it is done;
- **reduce** (:meth:`DataAnalyzer.run_reduce`, once, after every worker): joins the values and
  writes the index files (see :mod:`shardwise.data_efficiency.index_files`).

Changes from DeepSpeed's, and why: the map is resumable at batch granularity (a restarted
worker skips the batches whose files exist, where DeepSpeed restarts the worker's whole share);
the files are numpy's (no indexed-dataset reader); and only ``single_value_per_sample`` metrics
are supported (``accumulate_value_over_samples`` produces no per-sample index, and the sampler
cannot use it).

Example:
    >>> import tempfile
    >>> data = [[1] * n for n in (3, 1, 2, 1)]
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     a = DataAnalyzer(data, {"seqlen": lambda batch: [len(s) for s in batch]}, tmp,
    ...                      collate_fn=list, batch_size=2)
    ...     a.run_map(); a.run_reduce()
    ...     idx = read_index_to_sample(str(index_paths(tmp, "seqlen")["index_to_sample"]), "k")
    ...     [idx.row(i).tolist() for i in range(len(idx))]
    [[1, 3], [2], [0]]
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from shardwise.data_efficiency.index_files import (
    RaggedIndex,
    index_paths,
    read_index_to_sample,  # noqa: F401  (the docstring example reads with it)
    write_index,
)

__all__ = ["DataAnalyzer", "build_indices"]

MetricFn = Callable[[Any], Sequence[float]]


def build_indices(values: np.ndarray) -> tuple[np.ndarray, RaggedIndex, RaggedIndex]:
    """From per-sample values: ``(index_to_metric, index_to_sample, percentile_merged)``.

    Rows are the distinct values ascending, each with its sample ids ascending; the merged
    index concatenates consecutive rows until each holds at least ``len(values) // 100`` ids.
    """
    order = np.argsort(values, kind="stable")
    sorted_values = values[order]
    distinct, starts = np.unique(sorted_values, return_index=True)
    bounds = np.append(starts, len(values))
    rows = [order[bounds[i] : bounds[i + 1]] for i in range(len(distinct))]
    per_percentile = max(len(values) // 100, 1)
    merged: list[np.ndarray] = []
    pending: list[np.ndarray] = []
    for row in rows:
        pending.append(row)
        if sum(len(r) for r in pending) >= per_percentile:
            merged.append(np.concatenate(pending))
            pending = []
    if pending:
        merged.append(np.concatenate(pending))
    return distinct, RaggedIndex.from_rows(rows), RaggedIndex.from_rows(merged)


class DataAnalyzer:
    """Computes metrics over a map-style dataset and writes the curriculum index files.

    Args:
        dataset: anything with ``__len__`` and ``__getitem__``.
        metrics: ``{name: fn}``; ``fn(batch)`` returns one number per sample of the batch.
        save_path: the output folder (shared by all workers).
        batch_size: samples per metric call.
        collate_fn: merges a list of samples into the batch the functions receive (torch's
            default collate when None).
        num_workers: workers sharing the dataset; ``worker_id`` is this one.
        num_threads: threads of this worker.

    Raises:
        ValueError: no metric, a bad worker id, or a metric named twice (names are keys, so a
            mapping cannot repeat one; a sequence of pairs is checked).
    """

    def __init__(
        self,
        dataset: Any,
        metrics: Mapping[str, MetricFn] | Sequence[tuple[str, MetricFn]],
        save_path: str | os.PathLike[str],
        *,
        batch_size: int = 1000,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        num_workers: int = 1,
        worker_id: int = 0,
        num_threads: int = 1,
    ) -> None:
        pairs = list(metrics.items()) if isinstance(metrics, Mapping) else list(metrics)
        names = [name for name, _ in pairs]
        if not names:
            raise ValueError("DataAnalyzer: give at least one metric function")
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(
                f"DataAnalyzer: metric {repeated[0]!r} is named twice; give each metric one name"
            )
        if not 0 <= worker_id < num_workers:
            raise ValueError(f"DataAnalyzer: worker_id={worker_id} must be in [0, num_workers={num_workers})")
        if collate_fn is None:
            from torch.utils.data import default_collate

            collate_fn = default_collate
        self.dataset = dataset
        self.metrics = dict(pairs)
        self.save_path = Path(save_path)
        self.batch_size = batch_size
        self.collate_fn = collate_fn
        self.num_workers = num_workers
        self.worker_id = worker_id
        self.num_threads = max(1, num_threads)

    def _share(self, worker: int) -> range:
        n = len(self.dataset)
        return range(n * worker // self.num_workers, n * (worker + 1) // self.num_workers)

    def _chunks(self, worker: int) -> list[range]:
        share = self._share(worker)
        return [
            range(start, min(start + self.batch_size, share.stop))
            for start in range(share.start, share.stop, self.batch_size)
        ]

    def _chunk_file(self, metric: str, chunk: range) -> Path:
        return self.save_path / metric / "map" / f"{chunk.start:012d}_{chunk.stop:012d}.npy"

    def _run_chunk(self, chunk: range) -> None:
        todo = [m for m in self.metrics if not self._chunk_file(m, chunk).is_file()]
        if not todo:
            return  # done by an earlier run: resume
        batch = self.collate_fn([self.dataset[i] for i in chunk])
        for metric in todo:
            values = np.asarray([float(v) for v in self.metrics[metric](batch)], dtype=np.float64)
            if values.shape != (len(chunk),):
                raise ValueError(
                    f"DataAnalyzer: metric {metric!r} returned {values.shape[0]} values for a batch of "
                    f"{len(chunk)} samples; it must return one number per sample"
                )
            path = self._chunk_file(metric, chunk)
            tmp = path.with_name(path.name + ".tmp.npy")
            np.save(tmp, values)
            os.replace(tmp, path)

    def run_map(self) -> None:
        """Compute this worker's share (skipping batches already saved)."""
        for metric in self.metrics:
            (self.save_path / metric / "map").mkdir(parents=True, exist_ok=True)
        chunks = self._chunks(self.worker_id)
        if self.num_threads == 1:
            for chunk in chunks:
                self._run_chunk(chunk)
            return
        with ThreadPoolExecutor(self.num_threads) as pool:
            list(pool.map(self._run_chunk, chunks))

    def run_reduce(self) -> None:
        """Join every worker's values and write the index files (call once, after all maps).

        Raises:
            FileNotFoundError: a worker's batch is missing (its map has not finished).
        """
        for metric in self.metrics:
            parts = []
            for worker in range(self.num_workers):
                for chunk in self._chunks(worker):
                    path = self._chunk_file(metric, chunk)
                    if not path.is_file():
                        raise FileNotFoundError(
                            f"DataAnalyzer.run_reduce: {path} is missing: run run_map() for worker "
                            f"{worker} of {self.num_workers} first (it resumes where it stopped)"
                        )
                    parts.append(np.load(path))
            values = np.concatenate(parts) if parts else np.zeros(0)
            to_metric, to_sample, merged = build_indices(values)
            paths = index_paths(self.save_path, metric)
            np.save(paths["sample_to_metric"], values)
            np.save(paths["index_to_metric"], to_metric)
            write_index(paths["index_to_sample"], to_sample)
            write_index(paths["index_to_sample_percentile_merged"], merged)

    def run_map_reduce(self) -> None:
        """One process doing everything: every worker's map, then the reduce."""
        mine = self.worker_id
        for worker in range(self.num_workers):
            self.worker_id = worker
            self.run_map()
        self.worker_id = mine
        self.run_reduce()
