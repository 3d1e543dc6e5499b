"""The root config model: top-level scalars plus one typed model per section.

Defaults follow DeepSpeed 0.19.8 (``gradient_clipping`` 1.0, ``steps_per_print`` None);
see ``docs/config-defaults.md`` for every default that moved between versions and why
we picked the one we did.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from shardwise.config.sections.base import Section
from shardwise.config.sections.data_efficiency import DataEfficiencyConfig, LegacyCurriculumConfig
from shardwise.config.sections.features import (
    ActivationCheckpointingConfig,
    AutotuningConfig,
    CheckpointConfig,
    CompileConfig,
    HybridEngineConfig,
    PipelineConfig,
    TensorParallelConfig,
)
from shardwise.config.sections.legacy import (
    CompressionTrainingConfig,
    EigenvalueConfig,
    ElasticityConfig,
    NebulaConfig,
    ProgressiveLayerDropConfig,
    QuantizeTrainingConfig,
    SparseAttentionConfig,
)
from shardwise.config.sections.observability import (
    CometConfig,
    CommsLoggerConfig,
    CSVMonitorConfig,
    FlopsProfilerConfig,
    TensorBoardConfig,
    TimersConfig,
    WandbConfig,
)
from shardwise.config.sections.precision import (
    AmpConfig,
    BF16Config,
    DataTypesConfig,
    FP16Config,
    TorchAutocastConfig,
)
from shardwise.config.sections.training import OptimizerConfig, SchedulerConfig
from shardwise.config.sections.zero import AioConfig, ZeroConfig

CommDType = Literal["fp16", "bf16", "fp32"]


class ShardwiseConfig(Section):
    """Every key of a ds_config.json, validated. Batch sizes are filled by ``load_config``."""

    # batch and loop
    train_batch_size: int | None = None
    train_micro_batch_size_per_gpu: int | None = None
    gradient_accumulation_steps: int | None = None
    managed_gradient_accumulation: bool = True
    steps_per_print: int | None = Field(None, ge=1)  # None (or inf): never print
    dataloader_drop_last: bool = False
    disable_python_gc: bool = False
    wall_clock_breakdown: bool = False
    memory_breakdown: bool = False
    dump_state: bool = False
    log_level: Literal["debug", "info", "warning", "error", "critical"] | None = None
    vocabulary_size: int | None = None
    zero_allow_untested_optimizer: bool = False
    zero_force_ds_cpu_optimizer: bool = True
    use_data_before_expert_parallelism: bool = False
    sequence_parallel_size: int | None = Field(None, ge=1)
    data_parallel_size: int | None = Field(None, ge=1)
    timers: TimersConfig = Field(default_factory=TimersConfig)
    # optimisation
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    gradient_clipping: float = Field(1.0, ge=0)
    # shardwise extension: this many optimizer steps in a row with non-finite gradients stop the run
    max_consecutive_nonfinite_steps: int = Field(20, ge=1)
    # communication
    communication_data_type: CommDType | None = None
    seq_parallel_communication_data_type: CommDType = "fp32"
    prescale_gradients: bool = False
    gradient_predivide_factor: float = Field(1.0, gt=0)
    gradient_allreduce_op: Literal["mean", "sum"] = "mean"
    disable_allgather: bool = False
    sparse_gradients: bool = False
    # precision
    fp16: FP16Config = Field(default_factory=FP16Config)
    bf16: BF16Config = Field(default_factory=BF16Config)
    amp: AmpConfig = Field(default_factory=AmpConfig)
    torch_autocast: TorchAutocastConfig = Field(default_factory=TorchAutocastConfig)
    data_types: DataTypesConfig = Field(default_factory=DataTypesConfig)
    # ZeRO
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    aio: AioConfig = Field(default_factory=AioConfig)
    # features
    activation_checkpointing: ActivationCheckpointingConfig = Field(
        default_factory=ActivationCheckpointingConfig
    )
    autotuning: AutotuningConfig = Field(default_factory=AutotuningConfig)
    flops_profiler: FlopsProfilerConfig = Field(default_factory=FlopsProfilerConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    compile: CompileConfig = Field(default_factory=CompileConfig)
    tensor_parallel: TensorParallelConfig = Field(default_factory=TensorParallelConfig)
    hybrid_engine: HybridEngineConfig = Field(default_factory=HybridEngineConfig)
    expert_parallel: dict[str, Any] | None = None
    weight_quantization: dict[str, Any] | None = None
    datastates: dict[str, Any] | None = None
    # monitors
    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    csv_monitor: CSVMonitorConfig = Field(default_factory=CSVMonitorConfig)
    comet: CometConfig = Field(default_factory=CometConfig)
    comms_logger: CommsLoggerConfig | None = None
    # data efficiency
    data_efficiency: DataEfficiencyConfig = Field(default_factory=DataEfficiencyConfig)
    curriculum_learning: LegacyCurriculumConfig | None = None
    # sections DeepSpeed 0.19.8 removed; accepted with their documented meaning
    compression_training: CompressionTrainingConfig | None = None
    sparse_attention: SparseAttentionConfig | None = None
    elasticity: ElasticityConfig | None = None
    progressive_layer_drop: ProgressiveLayerDropConfig | None = None
    eigenvalue: EigenvalueConfig | None = None
    quantize_training: QuantizeTrainingConfig | None = None
    nebula: NebulaConfig | None = None
    graph_harvesting: bool = False

    @field_validator("communication_data_type", "seq_parallel_communication_data_type", mode="before")
    @classmethod
    def _comm_dtype(cls, value: object) -> object:
        if isinstance(value, str):
            lowered = value.lower()
            aliases = {
                "float16": "fp16",
                "half": "fp16",
                "bfloat16": "bf16",
                "float32": "fp32",
                "float": "fp32",
            }
            return aliases.get(lowered, lowered)
        return value

    @field_validator("gradient_allreduce_op", mode="before")
    @classmethod
    def _allreduce_op(cls, value: object) -> object:
        """Case does not matter ("SUM" is "sum", as in DeepSpeed); anything else is refused by name."""
        if isinstance(value, str) and value.lower() in ("mean", "sum"):
            return value.lower()
        raise ValueError(f"Invalid gradient_allreduce_op {value!r}: it must be 'mean' or 'sum'")

    @field_validator("max_consecutive_nonfinite_steps", mode="before")
    @classmethod
    def _no_bool_count(cls, value: object) -> object:
        if isinstance(value, bool):
            raise ValueError("must be a whole number of steps >= 1, not true/false (the default is 20)")
        return value

    @field_validator("steps_per_print", mode="before")
    @classmethod
    def _infinite_means_never(cls, value: object) -> object:
        # accelerate always writes float("inf") here: "never print", as DeepSpeed reads it
        if isinstance(value, float) and value == float("inf"):
            return None
        return value

    @field_validator("log_level", mode="before")
    @classmethod
    def _level_lower(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value

    # convenience views used by the engine and the CLI
    @property
    def precision(self) -> str:
        """``"fp16"``, ``"bf16"`` or ``"fp32"``."""
        return "fp16" if self.fp16.enabled else "bf16" if self.bf16.enabled else "fp32"

    @property
    def fp16_loss_scaling(self) -> bool:
        """True when the run computes in fp16 and so scales its loss (``fp16``, legacy ``amp``,
        or ``torch_autocast`` to float16); the ``fp16`` section's scaler settings apply then."""
        if self.fp16.enabled:
            return True
        if self.bf16.enabled:
            return False
        if self.amp.enabled:
            return True
        return self.torch_autocast.enabled and self.torch_autocast.dtype == "float16"

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage, 0-3."""
        return int(self.zero_optimization.stage)
