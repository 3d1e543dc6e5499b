"""``zero_optimization`` with its offload blocks, and ``aio`` (spec 3.7, 3.8).

Field names are the ones DeepSpeed's documentation uses (``stage3_*`` for stage 3);
the short spellings (``prefetch_bucket_size``) are accepted by ``compat``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from shardwise.config.sections.base import Section

OffloadDevice = Literal["none", "cpu", "nvme"]


class _OffloadBase(Section):
    @field_validator("device", mode="before", check_fields=False)
    @classmethod
    def _device_lower(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value

    @model_validator(mode="after")
    def _nvme_needs_path(self) -> _OffloadBase:
        if getattr(self, "device", "none") == "nvme" and getattr(self, "nvme_path", None) is None:
            raise ValueError("device 'nvme' needs nvme_path (a directory on a fast local disk)")
        return self


class OffloadParamConfig(_OffloadBase):
    """``zero_optimization.offload_param`` (stage 3 only)."""

    device: OffloadDevice = "none"
    nvme_path: Path | None = None
    buffer_count: int = Field(5, ge=0)
    buffer_size: int = Field(100_000_000, ge=0)
    max_in_cpu: int = Field(1_000_000_000, ge=0)
    pin_memory: bool = True


class OffloadOptimizerConfig(_OffloadBase):
    """``zero_optimization.offload_optimizer`` (stages 1-3)."""

    device: OffloadDevice = "none"
    nvme_path: Path | None = None
    buffer_count: int = Field(4, ge=0)
    pin_memory: bool = True
    pipeline_read: bool = False
    pipeline_write: bool = False
    fast_init: bool = False
    ratio: float = Field(1.0, ge=0.0, le=1.0)
    super_offload: bool = False
    cpuadam_cores_perc: float = Field(0.8, ge=0.0, le=1.0)


# DeepSpeed 0.19.8's defaults: sparse MoE blocks are fetched as one unit at stage 3.
DEFAULT_LEAF_MODULE_CLASSES = (
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
)


class LeafModuleConfig(Section):
    """``zero_optimization.leaf_module``: modules fetched as one unit at stage 3."""

    classes: list[str] = Field(default_factory=lambda: list(DEFAULT_LEAF_MODULE_CLASSES))
    names: list[str] = Field(default_factory=list)
    name_suffixes: list[str] = Field(default_factory=list)

    @field_validator("classes", "names", "name_suffixes", mode="before")
    @classmethod
    def _str_to_list(cls, value: object) -> object:
        return [value] if isinstance(value, str) else value


class ZeroConfig(Section):
    """``zero_optimization``: which ZeRO stage, and how it communicates."""

    stage: Literal[0, 1, 2, 3] = 0
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    reduce_bucket_size: int = Field(500_000_000, gt=0)
    use_multi_rank_bucket_allreduce: bool = True
    allgather_partitions: bool = True
    allgather_bucket_size: int = Field(500_000_000, ge=0)
    overlap_comm: bool | None = None
    compute_grad_norm: bool = True
    load_from_fp32_weights: bool = True
    elastic_checkpoint: bool = False
    sub_group_size: int = Field(1_000_000_000, ge=0)
    offload_param: OffloadParamConfig | None = None
    offload_optimizer: OffloadOptimizerConfig | None = None
    ignore_unused_parameters: bool = True
    legacy_stage1: bool = False
    round_robin_gradients: bool = False
    parameter_alignment: bool = False
    memory_efficient_linear: bool = True
    pipeline_loading_checkpoint: bool = False
    override_module_apply: bool = True
    log_trace_cache_warnings: bool = False
    enable_sanity_checks: bool = False
    save_muon_momentum_buffer_in_memory: bool = False
    leaf_module: LeafModuleConfig = Field(default_factory=LeafModuleConfig)
    zenflow: dict[str, object] | None = None
    # stage 3
    stage3_prefetch_bucket_size: int = Field(50_000_000, ge=0)
    stage3_param_persistence_threshold: int = Field(100_000, ge=0)
    stage3_model_persistence_threshold: int = Field(sys.maxsize, ge=0)
    stage3_max_live_parameters: int = Field(1_000_000_000, ge=0)
    stage3_max_reuse_distance: int = Field(1_000_000_000, ge=0)
    stage3_gather_16bit_weights_on_model_save: bool = False
    stage3_module_granularity_threshold: int = Field(0, ge=0)
    stage3_use_all_reduce_for_fetch_params: bool = False
    stage3_allgather_sequential: bool = False
    # ZeRO++
    zero_hpz_partition_size: int = Field(1, ge=0)
    zero_quantized_weights: bool = False
    zero_quantized_nontrainable_weights: bool = False
    zero_quantized_gradients: bool = False
    # MiCS: -1 means off. Hierarchical sharding is not implemented (see compat).
    mics_shard_size: int = -1
    mics_hierarchical_params_gather: bool = False

    @field_validator("stage", mode="before")
    @classmethod
    def _stage_from_text(cls, value: object) -> object:
        if isinstance(value, str) and value.strip().isdigit():
            return int(value)
        if isinstance(value, float) and value.is_integer():
            return int(value)
        return value

    @model_validator(mode="after")
    def _checks(self) -> ZeroConfig:
        if self.legacy_stage1:
            raise ValueError("legacy_stage1 (the pre-0.5.9 stage 1) is not supported; remove the key")
        opt = self.offload_optimizer
        if opt is not None and opt.ratio < 1.0 and self.stage != 3:
            raise ValueError(
                f"offload_optimizer.ratio={opt.ratio} (partial offload) needs stage 3, but stage is {self.stage}"
            )
        if not self.compute_grad_norm and self.stage not in (1, 2):
            raise ValueError("compute_grad_norm=false is only allowed at stage 1 or 2")
        return self

    @property
    def overlap_comm_effective(self) -> bool:
        """``overlap_comm`` with DeepSpeed's default: on for stage 3, off otherwise."""
        return self.stage == 3 if self.overlap_comm is None else self.overlap_comm

    @property
    def offload_optimizer_device(self) -> str:
        """``"none"``, ``"cpu"`` or ``"nvme"``."""
        return self.offload_optimizer.device if self.offload_optimizer else "none"

    @property
    def offload_param_device(self) -> str:
        """``"none"``, ``"cpu"`` or ``"nvme"``."""
        return self.offload_param.device if self.offload_param else "none"


class AioConfig(Section):
    """``aio``: asynchronous I/O for NVMe offload."""

    block_size: int = Field(1_048_576, gt=0)
    queue_depth: int = Field(8, gt=0)
    intra_op_parallelism: int = Field(1, gt=0)
    single_submit: bool = False
    overlap_events: bool = True
    use_gds: bool = False
