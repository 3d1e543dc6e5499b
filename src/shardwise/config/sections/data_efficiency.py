"""``data_efficiency`` and the legacy top-level ``curriculum_learning`` (spec 3.13, 12)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from shardwise.config.sections.base import Section

ScheduleType = Literal["fixed_linear", "fixed_root", "fixed_discrete", "custom"]


class CurriculumMetricConfig(Section):
    """One metric of ``data_sampling.curriculum_learning.curriculum_metrics``."""

    index_to_sample_path: str | None = None
    index_to_metric_path: str | None = None
    difficulty_type: Literal["value", "percentile"] = "value"
    clustering_type: Literal["single_cluster", "schedule_based"] = "single_cluster"
    # int | float keeps the written number's type (DeepSpeed hands the metric dict on as written)
    min_difficulty: int | float | None = None
    max_difficulty: int | float | None = None
    schedule_type: ScheduleType = "fixed_linear"
    schedule_config: dict[str, Any] = Field(default_factory=dict)


class SamplingCurriculumConfig(Section):
    """``data_sampling.curriculum_learning``."""

    enabled: bool = False
    data_cluster_path: str | None = None
    curriculum_metrics: dict[str, CurriculumMetricConfig] = Field(default_factory=dict)


class DynamicBatchingConfig(Section):
    """``data_sampling.dynamic_batching``."""

    enabled: bool = False
    lr_scaling_method: Literal["linear", "sqrt", "none"] = "linear"
    min_batch_size: int = Field(1, ge=1)
    max_batch_size: int | None = None
    sequence_picking_order: Literal["dataloader", "random", "seqlen"] = "dataloader"
    max_tokens: int | None = None
    metrics_path: str | None = None
    verbose: bool = False


class DataSamplingConfig(Section):
    """``data_efficiency.data_sampling``."""

    enabled: bool = False
    num_epochs: int = Field(1000, ge=1)
    num_workers: int = Field(0, ge=0)
    pin_memory: bool = False
    curriculum_learning: SamplingCurriculumConfig = Field(default_factory=SamplingCurriculumConfig)
    dynamic_batching: DynamicBatchingConfig = Field(default_factory=DynamicBatchingConfig)


class RandomLTDScheduleConfig(Section):
    """``random_ltd.random_ltd_schedule``."""

    min_value: int = 0
    max_value: int = 0
    schedule_type: str = "fixed_linear"
    schedule_config: dict[str, Any] = Field(default_factory=dict)


class RandomLTDConfig(Section):
    """``data_routing.random_ltd`` (random layerwise token dropping)."""

    enabled: bool = False
    total_layer_num: int | None = None
    random_ltd_layer_num: int | None = None
    random_ltd_layer_id: list[int] = Field(default_factory=list)
    model_mask_name: str | None = None
    model_type: str | None = None
    hidden_state_order: str | None = None
    random_ltd_schedule: RandomLTDScheduleConfig = Field(default_factory=RandomLTDScheduleConfig)
    layer_token_lr_schedule: dict[str, Any] | None = None


class DataRoutingConfig(Section):
    """``data_efficiency.data_routing``."""

    enabled: bool = False
    random_ltd: RandomLTDConfig = Field(default_factory=RandomLTDConfig)


class DataEfficiencyConfig(Section):
    """``data_efficiency``: acted on by :mod:`shardwise.data_efficiency` (the curriculum sampler in
    ``deepspeed_io``, the random-LTD step hook); ``dynamic_batching`` is not implemented (inert)."""

    enabled: bool = False
    seed: int = 1234
    data_sampling: DataSamplingConfig = Field(default_factory=DataSamplingConfig)
    data_routing: DataRoutingConfig = Field(default_factory=DataRoutingConfig)


class LegacyCurriculumConfig(Section):
    """Top-level ``curriculum_learning`` (removed in DeepSpeed 0.19.8; kept here).

    When enabled, every training forward receives ``curriculum_seqlen=<difficulty>``
    (:mod:`shardwise.data_efficiency.curriculum_hook`).
    """

    enabled: bool = False
    curriculum_type: str = "seqlen"
    min_difficulty: int = Field(1, ge=0)
    max_difficulty: int = Field(1, ge=0)
    schedule_type: ScheduleType = "fixed_linear"
    schedule_config: dict[str, Any] = Field(default_factory=dict)
