"""One curriculum metric as the sampler sees it: its schedule and which samples a difficulty admits.

Built from a ``curriculum_metrics.<name>`` section and the analyzer's index files:

- ``difficulty_type: "value"``: a sample is admitted when its metric value is ``<=`` the
  difficulty (``index_to_sample_path`` and ``index_to_metric_path`` are read);
- ``difficulty_type: "percentile"``: the difficulty ``d`` admits the first
  ``(num_samples // max_difficulty) * d`` samples in metric order (all of them at
  ``max_difficulty``), DeepSpeed's rule; only ``index_to_sample_path`` is read;
- ``clustering_type: "single_cluster"``: the metric admits every sample (its difficulty is
  still scheduled, e.g. for a model-side truncation), and no index file is needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from shardwise.config.errors import ConfigError
from shardwise.data_efficiency.index_files import read_index_to_metric, read_index_to_sample
from shardwise.data_efficiency.schedule import CurriculumSchedule

__all__ = ["MetricIndex", "build_metric_index"]


@dataclass
class MetricIndex:
    """A metric's schedule and its per-sample key.

    Attributes:
        name: the metric's name in the config.
        schedule: its difficulty schedule.
        difficulty_type: ``"value"`` or ``"percentile"``.
        clustered: False for ``single_cluster`` (admits everything).
        key: per sample, the number compared with the difficulty (the value, or the sample's
            rank in metric order for percentiles); None when not clustered.
    """

    name: str
    schedule: CurriculumSchedule
    difficulty_type: str
    clustered: bool
    key: np.ndarray | None

    def admitted(self, difficulty: float, num_samples: int) -> np.ndarray:
        """A boolean mask over the samples: those the difficulty admits."""
        if not self.clustered or self.key is None:
            return np.ones(num_samples, dtype=bool)
        if self.difficulty_type == "value":
            return self.key <= difficulty
        max_percentile = self.schedule.max_difficulty
        end = num_samples if difficulty >= max_percentile else (num_samples // max_percentile) * difficulty
        return self.key < end


def build_metric_index(name: str, section: Any, num_samples: int, where: str) -> MetricIndex:
    """Read a metric's index files and check them against the dataset.

    Raises:
        ConfigError: a required key or file is missing, or the files do not describe
            ``num_samples`` samples (the message names the key and the fix).
    """
    for required in ("min_difficulty", "max_difficulty"):
        if getattr(section, required) is None:
            raise ConfigError(f"{where}.{required}", "is required", f'add "{required}" to the metric')
    schedule = CurriculumSchedule(
        section.min_difficulty, section.max_difficulty, section.schedule_type, section.schedule_config, where
    )
    if section.clustering_type == "single_cluster":
        return MetricIndex(name, schedule, section.difficulty_type, False, None)
    if not section.index_to_sample_path:
        raise ConfigError(
            f"{where}.index_to_sample_path",
            "is required with clustering_type schedule_based",
            "run shardwise.data_efficiency.DataAnalyzer and give its index_to_sample file",
        )
    to_sample = read_index_to_sample(section.index_to_sample_path, f"{where}.index_to_sample_path")
    if len(to_sample.samples) != num_samples or (
        num_samples and (to_sample.samples.min() < 0 or to_sample.samples.max() >= num_samples)
    ):
        raise ConfigError(
            f"{where}.index_to_sample_path",
            f"indexes {len(to_sample.samples)} samples, but the training data has {num_samples}",
            "re-run the DataAnalyzer on this dataset",
            value=section.index_to_sample_path,
        )
    key = np.empty(num_samples, dtype=np.float64)
    if section.difficulty_type == "percentile":
        key[to_sample.samples] = np.arange(num_samples)
    else:
        if not section.index_to_metric_path:
            raise ConfigError(
                f"{where}.index_to_metric_path",
                'is required with difficulty_type "value"',
                "give the analyzer's index_to_metric file",
            )
        to_metric = read_index_to_metric(section.index_to_metric_path, f"{where}.index_to_metric_path")
        if len(to_metric) != len(to_sample):
            raise ConfigError(
                f"{where}.index_to_metric_path",
                f"has {len(to_metric)} rows but index_to_sample has {len(to_sample)}",
                "give the two files of the same analyzer run",
                value=section.index_to_metric_path,
            )
        sizes = np.diff(to_sample.offsets)
        key[to_sample.samples] = np.repeat(to_metric.astype(np.float64), sizes)
    return MetricIndex(name, schedule, section.difficulty_type, True, key)
