"""The data analyzer's index files against a brute-force computation; workers, threads, resume."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from shardwise.data_efficiency.analyzer import DataAnalyzer
from shardwise.data_efficiency.index_files import index_paths, read_index_to_metric, read_index_to_sample

RNG = np.random.default_rng(0)
DATA = [list(range(int(n))) for n in RNG.integers(1, 30, size=257)]
METRICS = {
    "seqlen": lambda batch: [len(s) for s in batch],
    "parity": lambda batch: [sum(s) % 3 for s in batch],
}


def _brute(values: list[float]) -> tuple[list[float], list[list[int]]]:
    distinct = sorted(set(values))
    return distinct, [[i for i, v in enumerate(values) if v == d] for d in distinct]


def _read(root: Path, metric: str) -> tuple[list[float], list[list[int]], list[list[int]]]:
    paths = index_paths(root, metric)
    to_metric = read_index_to_metric(str(paths["index_to_metric"]), "k").tolist()
    to_sample = read_index_to_sample(str(paths["index_to_sample"]), "k")
    merged = read_index_to_sample(str(paths["index_to_sample_percentile_merged"]), "k")
    return (
        to_metric,
        [to_sample.row(i).tolist() for i in range(len(to_sample))],
        [merged.row(i).tolist() for i in range(len(merged))],
    )


@pytest.mark.parametrize(("workers", "threads"), [(1, 1), (3, 2)])
def test_index_files_equal_a_brute_force_computation(tmp_path: Path, workers: int, threads: int) -> None:
    for worker in range(workers):
        DataAnalyzer(
            DATA,
            METRICS,
            tmp_path,
            batch_size=10,
            collate_fn=list,
            num_workers=workers,
            worker_id=worker,
            num_threads=threads,
        ).run_map()
    DataAnalyzer(DATA, METRICS, tmp_path, batch_size=10, collate_fn=list, num_workers=workers).run_reduce()
    for name, fn in METRICS.items():
        values = [float(v) for v in fn(DATA)]
        distinct, rows = _brute(values)
        to_metric, to_sample, merged = _read(tmp_path, name)
        assert to_metric == distinct and to_sample == rows
        flat = [i for row in rows for i in row]
        assert [i for row in merged for i in row] == flat  # same order, rows merged
        assert all(len(row) >= len(DATA) // 100 for row in merged[:-1])
        assert np.load(index_paths(tmp_path, name)["sample_to_metric"]).tolist() == values


def test_map_resumes_without_recomputing_saved_batches(tmp_path: Path) -> None:
    calls = []

    def seqlen(batch: list) -> list[int]:
        calls.append(len(batch))
        return [len(s) for s in batch]

    analyzer = DataAnalyzer(DATA, {"seqlen": seqlen}, tmp_path, batch_size=50, collate_fn=list)
    analyzer.run_map()
    first = len(calls)
    saved = sorted((tmp_path / "seqlen" / "map").iterdir())
    saved[-1].unlink()  # the run was interrupted before its last batch
    analyzer.run_map()
    assert first == 6 and len(calls) == 7
    analyzer.run_reduce()
    assert _read(tmp_path, "seqlen")[1] == _brute([float(len(s)) for s in DATA])[1]


def test_reduce_before_every_map_names_the_missing_worker(tmp_path: Path) -> None:
    DataAnalyzer(DATA, METRICS, tmp_path, collate_fn=list, num_workers=2, worker_id=0).run_map()
    with pytest.raises(FileNotFoundError, match="worker 1 of 2"):
        DataAnalyzer(DATA, METRICS, tmp_path, collate_fn=list, num_workers=2).run_reduce()


def test_a_metric_named_twice_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'seqlen' is named twice"):
        DataAnalyzer(DATA, [("seqlen", len), ("seqlen", len)], tmp_path)


def test_a_metric_must_return_one_value_per_sample(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="one number per sample"):
        DataAnalyzer(DATA, {"bad": lambda batch: [1]}, tmp_path, batch_size=4, collate_fn=list).run_map()
