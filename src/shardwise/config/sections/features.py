"""Smaller feature sections: activation checkpointing, autotuning, checkpoint,
pipeline, compile, tensor_parallel, hybrid_engine (spec 3.11, 3.12, 3.17, 3.19, 3.20)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from shardwise.config.sections.base import Section


class ActivationCheckpointingConfig(Section):
    """``activation_checkpointing``."""

    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: int | None = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False


class ModelInfoConfig(Section):
    """``autotuning.model_info``."""

    profile: bool = False
    num_params: int | None = None
    hidden_size: int | None = None
    num_layers: int | None = None


class AutotuningConfig(Section):
    """``autotuning``."""

    enabled: bool = False
    fast: bool = True
    results_dir: str = Field("autotuning_results", min_length=1)
    exps_dir: str = Field("autotuning_exps", min_length=1)
    overwrite: bool = True
    start_profile_step: int = Field(3, ge=0)
    end_profile_step: int = Field(5, ge=0)
    metric: Literal["latency", "throughput", "flops"] = "throughput"
    metric_path: str | None = None
    tuner_type: Literal["gridsearch", "random", "model_based"] = "gridsearch"
    tuner_early_stopping: int = Field(5, ge=0)
    tuner_num_trials: int = Field(50, gt=0)
    arg_mappings: dict[str, str] | None = None
    model_info: ModelInfoConfig = Field(default_factory=ModelInfoConfig)
    model_info_path: str | None = None
    mp_size: int = Field(1, ge=1)
    max_train_batch_size: int | None = None
    min_train_batch_size: int = Field(1, ge=1)
    max_train_micro_batch_size_per_gpu: int = Field(1024, ge=1)
    min_train_micro_batch_size_per_gpu: int = Field(1, ge=1)
    num_tuning_micro_batch_sizes: int = Field(3, ge=1)


class ParallelWriteConfig(Section):
    """``checkpoint.parallel_write``."""

    pipeline_stage: bool = False


class CheckpointWriterConfig(Section):
    """``checkpoint.writer``."""

    type: Literal["mock", "python", "fast"] = "fast"
    decoupled: bool = False
    io_buffer_size: int = Field(64 * 1024 * 1024, gt=0)
    io_buffer_double: bool = True
    show_statistics: bool = False
    data_parallel: Literal["replica", "socket", "machine"] = "replica"
    io_multiplier: int = Field(1, ge=1)


class CheckpointConfig(Section):
    """``checkpoint``: tag validation and writing options."""

    tag_validation: Literal["Ignore", "Warn", "Fail"] = "Warn"
    load_universal: bool = False
    use_node_local_storage: bool = False
    parallel_write: ParallelWriteConfig = Field(default_factory=ParallelWriteConfig)
    checkpoint_serialization: bool = True
    writer: CheckpointWriterConfig | None = None
    async_save: bool = False  # shardwise extension: write files while training continues
    # shardwise extension: a model with MoE layers also gets DeepSpeed's per-expert model files
    # (checkpoint/deepspeed_moe_save.py), at ZeRO stages 0-2
    deepspeed_moe_files: bool = True
    # shardwise extension: periodic snapshots the engine takes by itself (checkpoint/snapshots.py):
    # an asynchronous save every ``snapshot_interval`` optimizer steps into ``snapshot_dir``, the
    # ``snapshot_keep`` newest kept; ``load_checkpoint`` resumes from the newest that verifies
    snapshot_interval: int = Field(0, ge=0)
    snapshot_dir: str | None = None
    snapshot_keep: int = Field(1, ge=1)

    @field_validator("tag_validation", mode="before")
    @classmethod
    def _case_insensitive(cls, value: object) -> object:
        if isinstance(value, str):
            return {"ignore": "Ignore", "warn": "Warn", "fail": "Fail"}.get(value.lower(), value)
        return value


class PipelineConfig(Section):
    """``pipeline``: used only with a pipeline model."""

    stages: int | Literal["auto"] = "auto"
    partition: str = "best"
    seed_layers: bool = False
    activation_checkpoint_interval: int = Field(0, ge=0)
    pipe_partitioned: bool = True
    grad_partitioned: bool = True
    use_reentrant: bool = True
    # shardwise keys: which torch.distributed.pipelining schedule runs, and stages per rank for
    # the interleaved / V-shaped ones (shardwise.pipe.executor).
    schedule: Literal[
        "1f1b", "gpipe", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev"
    ] = "1f1b"
    virtual_stages: int = Field(1, ge=1)

    @field_validator("schedule", mode="before")
    @classmethod
    def _schedule_spelling(cls, value: object) -> object:
        # Real configs write DeepSpeed's schedule in capitals ("1F1B", a key DeepSpeed ignores)
        if isinstance(value, str):
            return value.strip().lower().replace("-", "_")
        return value


class CompileConfig(Section):
    """``compile``: DeepSpeed 0.19.8's keys (DeepCompile's flags) and the pre-0.17 spelling
    ``disable``/``backend``/``kwargs``. What each does here: ``shardwise.compilation`` (the keys
    that act: ``deepcompile``, ``debug_log``, ``autoep_non_moe``, ``disable``/``backend``/``kwargs``),
    ``config/inert.py`` (the ones named as ignored, with why) and ``config/compile_rules.py``
    (``passes``, refused by name)."""

    deepcompile: bool = False
    autoep_non_moe: bool = False
    free_activation: bool = False
    free_activation_threshold: int = Field(10 * 1024 * 1024, ge=0)
    offload_activation: bool = False
    offload_activation_pin_memory: bool = True
    offload_opt_states: bool = False
    double_buffer: bool = True
    symmetric_memory: bool = False
    debug_log: bool = False
    offload_parameters: bool = False
    sync_before_reduce: bool = False
    sync_after_reduce: bool = False
    sync_before_allgather: bool = False
    sync_after_allgather: bool = False
    keep_int_input_tensors: bool = True
    keep_all_input_tensors: bool = False
    passes: list[str] | None = None
    disable: bool = True
    backend: str = "inductor"
    kwargs: dict[str, Any] = Field(default_factory=dict)


class TensorParallelConfig(Section):
    """``tensor_parallel`` (DeepSpeed AutoTP training): ``autotp_size`` > 1 splits the model's
    linear layers over that many ranks (``shardwise.tensor_parallel``); the layer rules come from
    ``preset_model``, ``partition_config`` or the model's own ``_tp_plan``."""

    autotp_size: int = Field(0, ge=0)
    tp_overlap_comm: bool = False
    vocab_parallel_lm_head: bool | None = None
    vocab_parallel_ce_backend: Literal["torch", "liger"] = "torch"
    partition_config: dict[str, Any] | None = None
    preset_model: str | None = None
    tp_grain_size: int = Field(1, ge=1)
    tp: dict[str, Any] | None = None
    dtype: str | None = None
    keep_module_on_host: bool = False
    injection_policy_tuple: list[Any] | None = None
    replace_with_kernel_inject: bool = Field(False, alias="kernel_inject")


class HybridEngineConfig(Section):
    """``hybrid_engine`` (RLHF generation + training)."""

    enabled: bool = False
    max_out_tokens: int = Field(512, gt=0)
    inference_tp_size: int = Field(1, ge=1)
    release_inference_cache: bool = False
    pin_parameters: bool = True
    tp_gather_partition_size: int = Field(8, ge=1)
    enable_cuda_graph: bool = False
