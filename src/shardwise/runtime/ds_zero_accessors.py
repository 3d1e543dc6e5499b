"""DeepSpeed's ``zero_*`` engine accessors: each reads ``zero_optimization`` (or a top-level ZeRO key)
from the resolved config and returns what DeepSpeed 0.19.8's ``DeepSpeedEngine`` returns for it.

The offload accessors return shardwise's own section models (:class:`OffloadOptimizerConfig`,
:class:`OffloadParamConfig`), whose fields carry DeepSpeed's names and defaults. The reference test
(``tests/unit/runtime/test_ds_config_accessors.py``) compares every accessor with DeepSpeed's
recorded values (``benchmarks/record_deepspeed_accessors.py``).
"""

from __future__ import annotations

from typing import Any

from shardwise.config.sections.zero import OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig

# DeepSpeed's ``cpuadam_cores_perc()`` without an ``offload_optimizer`` block (its accessor's constant;
# the block's own default is 0.8).
CPUADAM_CORES_PERC_WITHOUT_OFFLOAD = 0.9


class DeepSpeedZeroAccessors:
    """Mixed into :class:`~shardwise.engine.ShardwiseEngine` through
    :class:`~shardwise.runtime.ds_config_accessors.DeepSpeedConfigAccessors` (needs ``_config``,
    ``optimizer``)."""

    _config: Any
    optimizer: Any

    @property
    def _zero(self) -> ZeroConfig:
        section: ZeroConfig = self._config.config.zero_optimization
        return section

    def zero_optimization(self) -> bool:
        """True at ZeRO stages 1-3."""
        return bool(self._zero.stage > 0)

    def zero_optimization_partition_gradients(self) -> bool:
        """True at stages 2 and 3 (gradients are partitioned)."""
        return bool(self._zero.stage >= 2)

    def zero_optimization_partition_weights(self) -> bool:
        """True at stage 3 (parameters are partitioned)."""
        return bool(self._zero.stage >= 3)

    def zero_allow_untested_optimizer(self) -> bool:
        """Top-level ``zero_allow_untested_optimizer``."""
        return bool(self._config.config.zero_allow_untested_optimizer)

    def zero_force_ds_cpu_optimizer(self) -> bool:
        """Top-level ``zero_force_ds_cpu_optimizer``."""
        return bool(self._config.config.zero_force_ds_cpu_optimizer)

    def zero_reduce_scatter(self) -> bool:
        """``zero_optimization.reduce_scatter``."""
        return self._zero.reduce_scatter

    def zero_overlap_comm(self) -> bool:
        """``zero_optimization.overlap_comm``; unset: on at stage 3, off below (DeepSpeed's default)."""
        return self._zero.overlap_comm_effective

    def zero_offload_optimizer(self) -> OffloadOptimizerConfig | None:
        """The ``offload_optimizer`` block (shardwise's model, DeepSpeed's field names), None without one."""
        return self._zero.offload_optimizer

    def zero_offload_param(self) -> OffloadParamConfig | None:
        """The ``offload_param`` block (shardwise's model, DeepSpeed's field names), None without one."""
        return self._zero.offload_param

    def zero_use_cpu_optimizer(self) -> bool:
        """True when the optimizer state is offloaded (``offload_optimizer.device`` cpu or nvme)."""
        return self._zero.offload_optimizer_device in ("cpu", "nvme")

    def zero_cpu_offload(self) -> bool:
        """True when ``offload_optimizer.device`` is cpu."""
        return self._zero.offload_optimizer_device == "cpu"

    def zero_nvme_offload_optimizer(self) -> bool:
        """True when the ZeRO optimizer swaps its state to NVMe (``offload_optimizer.device`` nvme). DeepSpeed
        answers from its stage-3 optimizer only; shardwise swaps at stages 1-3, and says so at each."""
        return self.optimizer is not None and self._zero.offload_optimizer_device == "nvme"

    def zero_partial_offload(self) -> float:
        """``offload_optimizer.ratio`` (1.0 without the block)."""
        block = self._zero.offload_optimizer
        return 1.0 if block is None else block.ratio

    def cpuadam_cores_perc(self) -> float:
        """``offload_optimizer.cpuadam_cores_perc``; 0.9 without the block (DeepSpeed's accessor constant)."""
        block = self._zero.offload_optimizer
        return CPUADAM_CORES_PERC_WITHOUT_OFFLOAD if block is None else block.cpuadam_cores_perc

    def zero_sub_group_size(self) -> int:
        """``zero_optimization.sub_group_size``."""
        return self._zero.sub_group_size

    def zero_reduce_bucket_size(self) -> int:
        """``zero_optimization.reduce_bucket_size``."""
        return self._zero.reduce_bucket_size

    def zero_multi_rank_bucket_allreduce(self) -> bool:
        """``zero_optimization.use_multi_rank_bucket_allreduce``."""
        return self._zero.use_multi_rank_bucket_allreduce

    def zero_allgather_bucket_size(self) -> int:
        """``zero_optimization.allgather_bucket_size``."""
        return self._zero.allgather_bucket_size

    def zero_allgather_partitions(self) -> bool:
        """``zero_optimization.allgather_partitions``."""
        return self._zero.allgather_partitions

    def zero_compute_grad_norm(self) -> bool:
        """``zero_optimization.compute_grad_norm``."""
        return self._zero.compute_grad_norm

    def zero_contiguous_gradients(self) -> bool:
        """``zero_optimization.contiguous_gradients``."""
        return self._zero.contiguous_gradients

    def zero_load_from_fp32_weights(self) -> bool:
        """``zero_optimization.load_from_fp32_weights``."""
        return self._zero.load_from_fp32_weights

    def zero_elastic_checkpoint(self) -> bool:
        """``zero_optimization.elastic_checkpoint``."""
        return self._zero.elastic_checkpoint

    def zero_max_live_parameters(self) -> int:
        """``zero_optimization.stage3_max_live_parameters``."""
        return self._zero.stage3_max_live_parameters

    def zero_max_reuse_distance(self) -> int:
        """``zero_optimization.stage3_max_reuse_distance``."""
        return self._zero.stage3_max_reuse_distance

    def zero_prefetch_bucket_size(self) -> int:
        """``zero_optimization.stage3_prefetch_bucket_size``."""
        return self._zero.stage3_prefetch_bucket_size

    def zero_module_granularity_threshold(self) -> int:
        """``zero_optimization.stage3_module_granularity_threshold``."""
        return self._zero.stage3_module_granularity_threshold

    def zero_param_persistence_threshold(self) -> int:
        """``zero_optimization.stage3_param_persistence_threshold``."""
        return self._zero.stage3_param_persistence_threshold

    def zero_model_persistence_threshold(self) -> int:
        """``zero_optimization.stage3_model_persistence_threshold``."""
        return self._zero.stage3_model_persistence_threshold

    def zero_allgather_sequential(self) -> bool:
        """``zero_optimization.stage3_allgather_sequential``."""
        return self._zero.stage3_allgather_sequential

    def zero_legacy_stage1(self) -> bool:
        """``zero_optimization.legacy_stage1`` (always False here: the config refuses True)."""
        return self._zero.legacy_stage1

    def zero_ignore_unused_parameters(self) -> bool:
        """``zero_optimization.ignore_unused_parameters``."""
        return self._zero.ignore_unused_parameters

    def zero_round_robin_gradients(self) -> bool:
        """``zero_optimization.round_robin_gradients``."""
        return self._zero.round_robin_gradients

    def zero_parameter_alignment(self) -> bool:
        """``zero_optimization.parameter_alignment``."""
        return self._zero.parameter_alignment

    def zero_save_muon_momentum_buffer_in_memory(self) -> bool:
        """``zero_optimization.save_muon_momentum_buffer_in_memory``."""
        return self._zero.save_muon_momentum_buffer_in_memory

    def zero_hpz_partition_size(self) -> int:
        """``zero_optimization.zero_hpz_partition_size`` (ZeRO++ hierarchical partitioning)."""
        return self._zero.zero_hpz_partition_size

    def zero_quantized_weights(self) -> bool:
        """``zero_optimization.zero_quantized_weights``."""
        return self._zero.zero_quantized_weights

    def zero_quantized_nontrainable_weights(self) -> bool:
        """``zero_optimization.zero_quantized_nontrainable_weights``."""
        return self._zero.zero_quantized_nontrainable_weights

    def zero_quantized_gradients(self) -> bool:
        """``zero_optimization.zero_quantized_gradients``."""
        return self._zero.zero_quantized_gradients

    def zero_log_trace_cache_warnings(self) -> bool:
        """``zero_optimization.log_trace_cache_warnings``."""
        return self._zero.log_trace_cache_warnings

    def is_sanity_checks_enabled(self) -> bool:
        """``zero_optimization.enable_sanity_checks``."""
        return self._zero.enable_sanity_checks

    def zenflow_config(self) -> dict[str, object] | None:
        """``zero_optimization.zenflow`` as written (a dict; DeepSpeed returns its ``ZenFlowConfig``
        model), None without one."""
        return self._zero.zenflow
