"""Build the curriculum sampler a config enables (``engine.deepspeed_io`` calls it)."""

from __future__ import annotations

from typing import NamedTuple

from shardwise.config.errors import ConfigError
from shardwise.config.model import ShardwiseConfig
from shardwise.data_efficiency.metric_index import build_metric_index
from shardwise.data_efficiency.sampler import CurriculumSampler

__all__ = [
    "TrainLoaderOptions",
    "build_curriculum_sampler",
    "curriculum_sampling_enabled",
    "train_loader_options",
]

_PATH = "data_efficiency.data_sampling.curriculum_learning"


def curriculum_sampling_enabled(config: ShardwiseConfig) -> bool:
    """``data_efficiency``, its ``data_sampling`` and their ``curriculum_learning`` are all enabled."""
    efficiency = config.data_efficiency
    sampling = efficiency.data_sampling
    return bool(efficiency.enabled and sampling.enabled and sampling.curriculum_learning.enabled)


def build_curriculum_sampler(
    config: ShardwiseConfig,
    *,
    num_samples: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    gradient_accumulation_steps: int,
) -> CurriculumSampler | None:
    """The sampler for an enabled data-sampling curriculum, else None.

    Raises:
        ConfigError: no metric, or a metric whose keys or index files are wrong (names the key).
    """
    if not curriculum_sampling_enabled(config):
        return None
    section = config.data_efficiency.data_sampling.curriculum_learning
    if not section.curriculum_metrics:
        raise ConfigError(
            f"{_PATH}.curriculum_metrics",
            "is empty: the curriculum needs at least one metric",
            "add a metric (with the DataAnalyzer's index files) or disable the section",
        )
    metrics = [
        build_metric_index(name, metric, num_samples, f"{_PATH}.curriculum_metrics.{name}")
        for name, metric in section.curriculum_metrics.items()
    ]
    return CurriculumSampler(
        metrics,
        num_samples=num_samples,
        micro_batch_size=micro_batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        gradient_accumulation_steps=gradient_accumulation_steps,
        num_epochs=config.data_efficiency.data_sampling.num_epochs,
        seed=config.data_efficiency.seed,
        cluster_path=section.data_cluster_path,
    )


class TrainLoaderOptions(NamedTuple):
    """What ``engine.deepspeed_io`` hands its loader for the training route."""

    data_sampler: object
    num_workers: int | None
    pin_memory: bool


def train_loader_options(
    config: ShardwiseConfig,
    *,
    num_samples: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    gradient_accumulation_steps: int,
    data_sampler: object,
    num_workers: int | None,
    pin_memory: bool,
) -> TrainLoaderOptions:
    """The training loader's sampler and worker options: the caller's, or the curriculum sampler's.

    A caller's own ``data_sampler`` wins. Otherwise, with the data-sampling curriculum enabled,
    the curriculum sampler draws the batches, and ``num_workers``/``pin_memory`` come from
    ``data_sampling`` unless the caller gave them.
    """
    chosen = data_sampler
    if chosen is None and curriculum_sampling_enabled(config):
        chosen = build_curriculum_sampler(
            config,
            num_samples=num_samples,
            micro_batch_size=micro_batch_size,
            dp_rank=dp_rank,
            dp_size=dp_size,
            gradient_accumulation_steps=gradient_accumulation_steps,
        )
        if chosen is not None:
            sampling = config.data_efficiency.data_sampling
            return TrainLoaderOptions(
                chosen, num_workers or sampling.num_workers, pin_memory or sampling.pin_memory
            )
    return TrainLoaderOptions(chosen, num_workers, pin_memory)
