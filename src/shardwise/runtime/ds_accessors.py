"""DeepSpeed engine accessors that only read what the engine holds: a mixin of thin methods.

The batch triple (``train_batch_size()``...), ``zero_optimization_stage()``, ``dp_world_size``,
``world_size``, ``global_rank``, ``loss_scale``, ``config``, ``sparse_attention``, and
``local_rank``, ``basic_optimizer``, ``mp_world_size``, ``fp16_enabled()``, ``bfloat16_enabled()``, ``gradient_clipping()``,
``log_level()``, ``managed_gradient_accumulation()``, ``steps_per_print()``, ``timers``, ``empty_partition_cache``. Kept out of ``engine.py`` so the engine stays the loop
(``load_module_state_dict`` needs the checkpoint package: ``checkpoint/engine_io.py``).
"""

from __future__ import annotations

from typing import Any

from shardwise import comm
from shardwise.config.resolve import ResolvedConfig
from shardwise.ops.sparse_attention.from_config import SparseAttentionBuilder


class DeepSpeedAccessors:
    """Mixed into :class:`~shardwise.engine.ShardwiseEngine` (which provides ``_config``,
    ``topology``, ``telemetry``, ``module`` and ``optimizer``, its ZeRO strategy)."""

    _config: Any
    topology: Any
    telemetry: Any
    module: Any
    optimizer: Any
    precision: Any

    # the batch triple, the stage, the sizes: what every DeepSpeed script reads
    @property
    def config(self) -> ResolvedConfig:
        """The resolved config: sections under ``engine.config.config`` (``.zero_optimization.stage``...),
        the batch triple as ``engine.config.batch``."""
        return self._config

    def train_batch_size(self) -> int:
        """Samples per optimizer step over all data-parallel ranks."""
        return self._config.batch.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        """Samples per rank per forward."""
        return self._config.batch.micro_batch_per_gpu

    def gradient_accumulation_steps(self) -> int:
        """Micro batches per optimizer step."""
        return self._config.batch.gradient_accumulation_steps

    def get_batch_info(self) -> tuple[int, int, int]:
        """``(train_batch_size, micro_batch, accumulation_steps)``."""
        return (
            self.train_batch_size(),
            self.train_micro_batch_size_per_gpu(),
            self.gradient_accumulation_steps(),
        )

    @property
    def sparse_attention(self) -> SparseAttentionBuilder | None:
        """The ``sparse_attention`` section as a builder of sparse attention layers, or None without one.

        ``engine.sparse_attention.self_attention(num_heads, max_seq_length)`` builds a
        ``SparseSelfAttention`` (see :mod:`shardwise.ops.sparse_attention`).
        """
        section = self._config.config.sparse_attention
        return None if section is None else SparseAttentionBuilder(section)

    def zero_optimization_stage(self) -> int:
        """The ZeRO stage, 0-3."""
        return self._config.config.zero_stage

    @property
    def dp_world_size(self) -> int:
        """Data-parallel ranks."""
        return self.topology.dp_size

    @property
    def world_size(self) -> int:
        """All ranks."""
        return self.topology.world_size

    @property
    def global_rank(self) -> int:
        """This process's rank."""
        return self.topology.world_rank

    @property
    def loss_scale(self) -> float:
        """Current loss scale (1.0 without fp16)."""
        return self.precision.loss_scaler.loss_scale

    @property
    def local_rank(self) -> int:
        """This process's rank on its node."""
        return int(comm.get_local_rank())

    @property
    def basic_optimizer(self) -> Any:
        """DeepSpeed's name for the torch optimizer ZeRO wraps (its param groups carry the config's
        settings, e.g. Muon's ``use_muon`` halves); None without an optimizer."""
        return None if self.optimizer is None else self.optimizer.optimizer

    @property
    def mp_world_size(self) -> int:
        """Model-parallel ranks (1 without an ``mpu``)."""
        return int(self.topology.mp_size)

    @property
    def checkpoint_mp_rank(self) -> int:
        """The model-parallel rank that names this rank's checkpoint files (0 without model parallelism)."""
        return int(self.topology.mp_rank) if self.topology.mp_size > 1 else 0

    @property
    def data_parallel_group(self) -> Any:
        """The data-parallel group (None: the world, or a degree of 1 under sequence parallelism)."""
        return self.topology.dp_group

    @property
    def seq_parallel_group(self) -> Any:
        """The sequence-parallel group (None without sequence parallelism)."""
        return self.topology.sp_group

    @property
    def sequence_parallel_size(self) -> int:
        """The sequence-parallel degree (``sequence_parallel_size``; 1 without it)."""
        return int(self.topology.sp_size)

    @property
    def seq_data_parallel_group(self) -> Any:
        """The group ZeRO shards and averages gradients over: data x sequence parallel."""
        return self.topology.shard_group

    @property
    def seq_dp_world_size(self) -> int:
        """The size of :attr:`seq_data_parallel_group`."""
        return int(self.topology.shard_size)

    def fp16_enabled(self) -> bool:
        """``fp16.enabled``."""
        return bool(self._config.config.fp16.enabled)

    def bfloat16_enabled(self) -> bool:
        """``bf16.enabled``."""
        return bool(self._config.config.bf16.enabled)

    def autotp_size(self) -> int:
        """``tensor_parallel.autotp_size`` (DeepSpeed's accessor; 0 or 1: no tensor parallelism)."""
        return int(self._config.config.tensor_parallel.autotp_size)

    def gradient_clipping(self) -> float:
        """``gradient_clipping`` (0: no clipping)."""
        return float(self._config.config.gradient_clipping)

    def managed_gradient_accumulation(self) -> bool:
        """``managed_gradient_accumulation``: False when each ``step()`` ends the accumulation window."""
        return bool(self._config.config.managed_gradient_accumulation)

    def log_level(self) -> str | None:
        """``log_level`` as a ``logging`` level name (``"ERROR"``); None when the config sets none."""
        level: str | None = self._config.config.log_level
        return None if level is None else level.upper()

    def steps_per_print(self) -> int | None:
        """``steps_per_print`` (None: never print)."""
        steps: int | None = self._config.config.steps_per_print
        return steps

    @property
    def timers(self) -> Any:
        """The wall-clock timers (``wall_clock_breakdown``)."""
        return self.telemetry.timers

    def empty_partition_cache(self) -> None:
        """Free the gathered copies of partitioned (stage-3) parameters; the next forward gathers them
        again (the strategy's ``release_gathered_parameters``). A no-op at stages 0-2."""
        if self.optimizer is not None:
            self.optimizer.release_gathered_parameters()
