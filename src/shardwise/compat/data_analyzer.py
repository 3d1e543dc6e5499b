"""``deepspeed.runtime.data_pipeline.data_sampling.data_analyzer.DataAnalyzer``: DeepSpeed's arguments on
shardwise's analyzer (:class:`shardwise.data_efficiency.analyzer.DataAnalyzer`).

The analysis scripts of Megatron-DeepSpeed and DeepSpeedExamples build it with parallel lists
(``metric_names``, ``metric_functions``, ``metric_types``, ``metric_dtypes``) and call ``run_map()`` per
worker, then ``run_reduce()`` once. The index files land at DeepSpeed's paths
(``<save_path>/<metric>/<metric>_index_to_sample_percentile_merged`` ...), which the config's
``index_to_sample_path`` / ``index_to_metric_path`` name, in shardwise's numpy format, which its
curriculum sampler reads (DeepSpeed's ``.bin``/``.idx`` pair is not written).

What acts as in DeepSpeed: the worker split, ``batch_size``, ``collate_fn``, ``num_threads`` (threads
here, processes there) and ``metric_dtypes``, which, as in DeepSpeed's map, each metric's values must
have (a mismatch raises naming the metric). ``num_threads_reduce`` sets only the reduce's parallelism,
and shardwise's reduce is one pass: it has no effect on the files. Refused by name (shardwise's
analyzer has no such step): ``accumulate_value_over_samples`` metrics, ``specific_threads``, the
``custom_map_*`` / ``custom_reduce`` hooks and ``sample_indices``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from shardwise.data_efficiency.analyzer import DataAnalyzer as _ShardwiseAnalyzer

__all__ = ["DataAnalyzer"]

SINGLE_VALUE = "single_value_per_sample"


def _checked(name: str, fn: Callable[[Any], Any], dtype: Any) -> Callable[[Any], Any]:
    """``fn`` whose result must have ``dtype`` (DeepSpeed's map asserts ``values.dtype == metric_dtype``)."""

    def metric(batch: Any) -> Any:
        values = fn(batch)
        got = getattr(values, "dtype", type(values))
        if got != dtype:
            raise ValueError(f"DataAnalyzer: metric {name!r} returned values of dtype {got}, but metric_dtypes "
                             f"gives {dtype}; return that dtype or change metric_dtypes")
        return values

    return metric


def _refuse(key: str, value: object, why: str) -> None:
    raise ValueError(f"DataAnalyzer({key}={value!r}): {why}")


class DataAnalyzer(_ShardwiseAnalyzer):
    """Per-sample metrics and the curriculum index files, from DeepSpeed's arguments (see the module docstring).

    Raises:
        ValueError: the metric lists differ in length, a metric is not ``single_value_per_sample``, or an
            argument shardwise has no step for is set.
    """

    def __init__(self, dataset: Any, num_workers: int = 1, worker_id: int = 0, num_threads: int = 1,
                 num_threads_reduce: int = 1, specific_threads: Sequence[int] = (), batch_size: int = 1,
                 metric_names: Sequence[str] = (), metric_functions: Sequence[Callable[[Any], Any]] = (),
                 metric_types: Sequence[str] = (), metric_dtypes: Sequence[Any] = (), save_path: str = "./",
                 collate_fn: Callable[[list[Any]], Any] | None = None, custom_map_init: Any = None,
                 custom_map_update: Any = None, custom_map_finalize: Any = None, custom_reduce: Any = None,
                 sample_indices: Any = None) -> None:
        lengths = {len(metric_names), len(metric_functions), len(metric_types), len(metric_dtypes)}
        if len(lengths) != 1:
            _refuse("metric_names", list(metric_names), "metric_names, metric_functions, metric_types and "
                    "metric_dtypes must have one entry per metric")
        for name, kind in zip(metric_names, metric_types, strict=True):
            if kind != SINGLE_VALUE:
                _refuse("metric_types", list(metric_types), f"metric {name!r} is {kind!r}; shardwise's analyzer "
                        f"computes {SINGLE_VALUE!r} metrics only (the curriculum sampler reads no other kind)")
        for key, value in (("specific_threads", list(specific_threads)), ("custom_map_init", custom_map_init),
                           ("custom_map_update", custom_map_update), ("custom_map_finalize", custom_map_finalize),
                           ("custom_reduce", custom_reduce), ("sample_indices", sample_indices)):
            if value:
                _refuse(key, value, "shardwise's analyzer has no such step; leave it unset (its map resumes "
                        "batch by batch instead of running chosen threads)")
        metrics = [(name, _checked(name, fn, dtype))
                   for name, fn, dtype in zip(metric_names, metric_functions, metric_dtypes, strict=True)]
        super().__init__(dataset, metrics, save_path, batch_size=batch_size, collate_fn=collate_fn,
                         num_workers=num_workers, worker_id=worker_id, num_threads=num_threads)
        self.num_threads_reduce = num_threads_reduce
