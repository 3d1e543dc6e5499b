"""Sections DeepSpeed 0.19.8 removed but whose files are still everywhere
(spec 3.16, 10): compression_training, sparse_attention, elasticity,
progressive_layer_drop, eigenvalue, quantize_training, nebula.

They are accepted and validated with their documented (<=0.19.6) meaning so that old
files keep working; the features behind them are built in later issues.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, model_validator

from shardwise.config.sections.base import OpenSection, Section


class TechniqueGroup(Section):
    """One named group of a compression technique: its params and target modules."""

    params: dict[str, Any] = Field(default_factory=dict)
    modules: list[str] = Field(default_factory=lambda: ["*"])
    related_modules: list[Any] | None = None


class _Technique(Section):
    shared_parameters: dict[str, Any] = Field(default_factory=dict)
    different_groups: dict[str, TechniqueGroup] = Field(default_factory=dict)


class LayerReductionConfig(Section):
    """``compression_training.layer_reduction``."""

    enabled: bool = False
    keep_number_layer: int | None = None
    module_name_prefix: str = ""
    teacher_layer: list[int] = Field(default_factory=list)
    other_module_name: list[str] = Field(default_factory=list)


class CompressionTrainingConfig(Section):
    """``compression_training``: quantization and pruning schedules."""

    layer_reduction: LayerReductionConfig = Field(default_factory=LayerReductionConfig)
    weight_quantization: _Technique = Field(default_factory=_Technique)
    activation_quantization: _Technique = Field(default_factory=_Technique)
    sparse_pruning: _Technique = Field(default_factory=_Technique)
    row_pruning: _Technique = Field(default_factory=_Technique)
    head_pruning: _Technique = Field(default_factory=_Technique)
    channel_pruning: _Technique = Field(default_factory=_Technique)


class SparseAttentionConfig(Section):
    """``sparse_attention``: block-sparse attention layout."""

    mode: Literal["dense", "fixed", "bigbird", "bslongformer", "variable"] = "fixed"
    block: int = Field(16, gt=0)
    different_layout_per_head: bool = False
    num_local_blocks: int = Field(4, ge=0)
    num_global_blocks: int = Field(1, ge=0)
    attention: Literal["bidirectional", "unidirectional"] = "bidirectional"
    horizontal_global_attention: bool = False
    num_different_global_patterns: int = Field(1, ge=1)
    num_random_blocks: int = Field(0, ge=0)
    local_window_blocks: list[int] = Field(default_factory=lambda: [4])
    global_block_indices: list[int] = Field(default_factory=lambda: [0])
    global_block_end_indices: list[int] | None = None
    num_sliding_window_blocks: int = Field(3, ge=0)


class ElasticityConfig(Section):
    """``elasticity``: batch sizes valid across a range of GPU counts (spec 10).

    The block's rules live in one place, :meth:`shardwise.elasticity.ElasticityConfig.from_dict`
    (the launcher and ``compute_elastic_config`` read raw JSON with it too); this section
    runs them before its fields are read, so a mistake is reported once, in those words.
    """

    enabled: bool = False
    max_train_batch_size: int = 2000
    micro_batch_sizes: list[int] = Field(default_factory=lambda: [2, 4, 6])
    min_gpus: int = 1
    max_gpus: int = 10000
    num_gpus_per_node: int = 1
    model_parallel_size: int = 1
    min_time: int = 0
    prefer_larger_batch: bool = True
    ignore_non_elastic_batch_info: bool = False
    version: float = 0.2

    @model_validator(mode="before")
    @classmethod
    def _checks(cls, data: object) -> object:
        if isinstance(data, Mapping):
            from shardwise.elasticity import ElasticityConfig as Rules

            Rules.from_dict(data)  # raises ElasticityConfigError (a ValueError) naming the key
        return data


class ProgressiveLayerDropConfig(Section):
    """``progressive_layer_drop``: keep probability ``(1-theta)*exp(-gamma*step)+theta``."""

    enabled: bool = False
    theta: float = 1.0
    gamma: float = 0.001


class EigenvalueConfig(Section):
    """``eigenvalue``: power-iteration Hessian eigenvalue (used with MoQ)."""

    enabled: bool = False
    verbose: bool = False
    max_iter: int = Field(100, gt=0)
    tol: float = 1e-2
    stability: float = 1e-6
    gas_boundary_resolution: int = Field(1, gt=0)
    layer_name: str = "bert.encoder.layer"
    layer_num: int = Field(0, ge=0)


class QuantizeTrainingConfig(OpenSection):
    """``quantize_training`` (MoQ): accepted with its options recorded."""

    enabled: bool = False


class NebulaConfig(OpenSection):
    """``nebula`` (Azure's checkpoint service). Accepted only when disabled: we cannot
    reach that service, and silently writing local files instead would surprise."""

    enabled: bool = False
