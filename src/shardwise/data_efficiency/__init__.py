"""Data efficiency: curriculum learning (legacy and data-sampling) and random-LTD.

- :mod:`~shardwise.data_efficiency.schedule`: the difficulty and kept-length schedules;
- :mod:`~shardwise.data_efficiency.curriculum_hook`: legacy ``curriculum_learning`` (the
  ``curriculum_seqlen=`` forward argument), :mod:`~shardwise.data_efficiency.truncation` for
  models that do not take it;
- :mod:`~shardwise.data_efficiency.analyzer`, :mod:`~shardwise.data_efficiency.index_files`,
  :mod:`~shardwise.data_efficiency.metric_index`, :mod:`~shardwise.data_efficiency.sampler`:
  ``data_sampling.curriculum_learning`` (offline analysis, then curriculum sampling);
- :mod:`~shardwise.data_efficiency.random_ltd`, :mod:`~shardwise.data_efficiency.random_ltd_hook`:
  ``data_routing.random_ltd``.
"""

from shardwise.data_efficiency.analyzer import DataAnalyzer
from shardwise.data_efficiency.random_ltd import RandomLTDLayer, convert_to_random_ltd
from shardwise.data_efficiency.sampler import CurriculumSampler
from shardwise.data_efficiency.schedule import CurriculumSchedule, RandomLTDSchedule
from shardwise.data_efficiency.truncation import SeqlenTruncation, truncate_to_seqlen

__all__ = [
    "CurriculumSampler",
    "CurriculumSchedule",
    "DataAnalyzer",
    "RandomLTDLayer",
    "RandomLTDSchedule",
    "SeqlenTruncation",
    "convert_to_random_ltd",
    "truncate_to_seqlen",
]
