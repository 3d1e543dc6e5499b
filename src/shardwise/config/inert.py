"""Settings shardwise accepts but does not act on: the one registry.

A ds_config file written for DeepSpeed may set keys whose feature shardwise does not have
(yet), or whose meaning is fixed here by design. Each such key is listed in
:data:`INERT_KEYS` with what happens instead. ``load_config`` reports every entry that
applies to a config as one warning (``initialize`` logs it; ``shardwise config check``
lists them under their own heading), and ``strict=True`` (``--strict``) makes them errors.

A key is reported only when the file sets it to something other than its default (or
enables the section): a key left at its default changes nothing, so it is not reported.
When a feature is implemented, its entries are removed from this table.

Example:
    >>> from shardwise.config import load_config
    >>> cfg = load_config({"train_batch_size": 2, "zero_optimization": {"contiguous_gradients": False}})
    >>> print(cfg.ignored[0].message)
    'zero_optimization.contiguous_gradients' = False has no effect: always on: gradients are always contiguous (flat buffers at stages 0-2, one contiguous shard per unit at stage 3)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from shardwise.config.errors import ConfigError
from shardwise.config.model import ShardwiseConfig

Applies = Callable[[ShardwiseConfig, Any, int], bool]
"""``applies(config, value_at_path, world_size)``: True when the file's setting is ignored."""

_ABSENT = object()


def _value_at(cfg: BaseModel, path: str) -> object:
    node: Any = cfg
    for part in path.split("."):
        if not isinstance(node, BaseModel) or part not in type(node).model_fields:
            return _ABSENT
        node = getattr(node, part)
    return node


def _default_at(path: str) -> object:
    from shardwise.config.auto import _model_in

    model: Any = ShardwiseConfig
    default: Any = _ABSENT
    for part in path.split("."):
        if model is None or part not in model.model_fields:
            return _ABSENT
        info = model.model_fields[part]
        default = info.get_default(call_default_factory=True)
        model = _model_in(info.annotation)
    return default


def _enabled(cfg: ShardwiseConfig, value: object, world: int) -> bool:
    return value is not None and bool(getattr(value, "enabled", False))


def _present(cfg: ShardwiseConfig, value: object, world: int) -> bool:
    return value is not None


@dataclass(frozen=True)
class InertKey:
    """One key or section accepted without effect.

    Attributes:
        path: dotted key path, as in the file (``"zero_optimization.reduce_scatter"``).
        instead: what happens instead, or why the key means nothing here.
        applies: when the setting is ignored; by default, whenever it differs from its default.
        stages: the ZeRO stages at which the key is ignored.
        verdict: how the message says it (``"has no effect"``, or what is left out).
    """

    path: str
    instead: str
    applies: Applies | None = None
    stages: frozenset[int] = frozenset({0, 1, 2, 3})
    verdict: str = "has no effect"

    def ignored_in(self, cfg: ShardwiseConfig, world_size: int) -> bool:
        """True when ``cfg`` sets this key and shardwise ignores it."""
        if cfg.zero_stage not in self.stages:
            return False
        value = _value_at(cfg, self.path)
        if value is _ABSENT:
            return False
        if self.applies is not None:
            return self.applies(cfg, value, world_size)
        default = _default_at(self.path)
        return value is not None and default is not _ABSENT and value != default


@dataclass(frozen=True)
class IgnoredSetting:
    """A setting of one config that shardwise ignores, with the reason."""

    path: str
    value: Any
    instead: str
    verdict: str = "has no effect"

    @property
    def message(self) -> str:
        """One line naming the key, its value and what happens instead."""
        subject = (
            f"section '{self.path}'"
            if isinstance(self.value, BaseModel)
            else f"'{self.path}' = {self.value!r}"
        )
        return f"{subject} {self.verdict}: {self.instead}"

    def as_error(self) -> ConfigError:
        """The strict-mode form: a ConfigError with the key, the value and a fix."""
        rule = f"{self.verdict} ({self.instead}), and strict mode allows no ignored settings"
        fix = "remove the key (or leave it at its default), or run without --strict"
        if isinstance(self.value, BaseModel):  # a whole section: its dump would bury the message
            return ConfigError(self.path, f"section {rule}", fix)
        return ConfigError(self.path, rule, fix, value=self.value)


def _hpz_unused(cfg: ShardwiseConfig, value: Any, world: int) -> bool:
    if value <= 1:
        return False
    return cfg.zero_stage != 3 or not (value < world and world % value == 0)


def _param_offload_below_stage3(cfg: ShardwiseConfig, value: object, world: int) -> bool:
    return cfg.zero_optimization.offload_param_device != "none"


def _legacy_compile_off(cfg: ShardwiseConfig, value: object, world: int) -> bool:
    key = "backend" if isinstance(value, str) else "kwargs"
    return cfg.compile.disable and value != _default_at(f"compile.{key}")


def _set_without_optimizer_offload(cfg: ShardwiseConfig, value: object, world: int) -> bool:
    default = _default_at("zero_optimization.sub_group_size")
    return value != default and cfg.zero_optimization.offload_optimizer_device == "none"


_BELOW_3 = frozenset({0, 1, 2})
_AT_3 = frozenset({3})

INERT_KEYS: tuple[InertKey, ...] = (
    # top level
    InertKey(
        "disable_allgather",
        "stage 0 gathers nothing and stage 3's FSDP2 gathers units with all-gather; at stages 1-2 the "
        "updated shards are broadcast from their owners instead",
        None,
        frozenset({0, 3}),
    ),
    InertKey(
        "sparse_gradients",
        "by design: gradients are reduced densely (flat buffers at stages 0-2, FSDP2 shards at stage 3), "
        "so the sums are the same and only the message size differs",
    ),
    InertKey("disable_python_gc", "Python's garbage collector is left as it is"),
    InertKey("vocabulary_size", "not read by shardwise"),
    InertKey(
        "use_data_before_expert_parallelism",
        "expert-parallel groups are runs of consecutive ranks (DeepSpeed's default order, built by comm.mesh); "
        "the data-first order is not built",
    ),
    InertKey(
        "data_parallel_size", "the data-parallel size comes from the launch (world size / model parallel)"
    ),
    InertKey("graph_harvesting", "CUDA graphs are not captured"),
    InertKey("weight_quantization", "weights are not quantized", _present),
    InertKey("datastates", "checkpoints are written by shardwise's own writer", _present),
    InertKey(
        "optimizer.legacy_fusion", "the optimizer's kernel is chosen by shardwise (fused where torch has it)"
    ),
    # precision
    InertKey("fp16.fp16_master_weights_and_grads", "master weights and gradients are always fp32"),
    InertKey("bf16.immediate_grad_update", "gradients are applied at the optimizer step"),
    InertKey("bf16.bf16_master_weights_and_grads", "master weights and gradients are always fp32"),
    InertKey("bf16.bf16_optimizer_states", "optimizer states are always fp32"),
    InertKey(
        "amp.opt_level",
        "every opt_level means autocast to fp16 with dynamic loss scaling here",
        lambda cfg, value, world: cfg.amp.enabled and value != "O1",
    ),
    InertKey("torch_autocast.lower_precision_safe_modules", "autocast applies torch's own per-op rules"),
    # ZeRO, every stage
    InertKey(
        "zero_optimization.contiguous_gradients",
        "always on: gradients are always contiguous (flat buffers at stages 0-2, one contiguous shard "
        "per unit at stage 3)",
    ),
    InertKey(
        "zero_optimization.reduce_scatter",
        "stage 0 always all-reduces and stage 3's FSDP2 always reduce-scatters (false acts at stages 1-2: "
        "all-reduce, then slice)",
        None,
        frozenset({0, 3}),
    ),
    InertKey(
        "zero_optimization.allgather_bucket_size",
        "stage 0 gathers nothing and FSDP2 gathers one unit per collective at stage 3 (stages 1-2 split "
        "their all-gathers to this size)",
        None,
        frozenset({0, 3}),
    ),
    InertKey(
        "zero_optimization.allgather_partitions",
        "stage 0 gathers nothing and FSDP2 gathers with all-gather at stage 3 (false broadcasts each shard "
        "at stages 1-2)",
        None,
        frozenset({0, 3}),
    ),
    InertKey(
        "zero_optimization.round_robin_gradients",
        "by design: gradient shards are assigned to ranks in order; DeepSpeed's round robin only spreads its "
        "CPU-offload gradient copies over ranks, the sums and the update are the same",
    ),
    InertKey("zero_optimization.use_multi_rank_bucket_allreduce", "buckets are reduced one collective each"),
    InertKey(
        "zero_optimization.elastic_checkpoint",
        "always on: checkpoints are topology-free, any number of ranks at any stage can load them",
    ),
    InertKey(
        "zero_optimization.compute_grad_norm",
        "the global gradient norm is always computed (get_global_grad_norm works)",
    ),
    InertKey(
        "zero_optimization.zero_quantized_weights",
        "stage 0 gathers no weights (the quantized all-gather, ZeRO++ qwZ, is used at stages 1-3)",
        None,
        frozenset({0}),
    ),
    InertKey(
        "zero_optimization.zero_quantized_nontrainable_weights",
        "frozen weights are not quantized; they stay in the training dtype",
    ),
    InertKey(
        "zero_optimization.zero_quantized_gradients",
        "the quantized gradient reduce-scatter (ZeRO++ qgZ) is used at stage 3; at stages 0-2 gradients "
        "travel in the communication dtype",
        None,
        _BELOW_3,
    ),
    InertKey(
        "zero_optimization.zero_hpz_partition_size",
        "hpZ secondary partitions are used only at stage 3 with a size that divides the data-parallel "
        "world size and is smaller than it; parameters are gathered from all ranks",
        _hpz_unused,
    ),
    InertKey("zero_optimization.parameter_alignment", "flat buffers use shardwise's own alignment"),
    InertKey(
        "zero_optimization.save_muon_momentum_buffer_in_memory",
        "Muon's momentum buffer is optimizer state like Adam's moments: it is kept (and offloaded) with the rest",
    ),
    InertKey("zero_optimization.zenflow", "ZenFlow is not implemented", _present),
    InertKey("zero_optimization.mics_hierarchical_params_gather", "MiCS is not supported"),
    InertKey("zero_optimization.offload_optimizer.fast_init", "state files are created at the first step"),
    InertKey("zero_optimization.offload_optimizer.super_offload", "SuperOffload is not implemented"),
    InertKey(
        "zero_optimization.offload_optimizer.cpuadam_cores_perc",
        "the CPU step uses torch's kernels and thread setting",
    ),
    InertKey("zero_optimization.offload_param.max_in_cpu", "there is no separate CPU parameter cache"),
    InertKey("aio.use_gds", "GPUDirect Storage is not used; reads go through host memory"),
    # ZeRO, by stage
    InertKey(
        "zero_optimization.offload_param",
        "parameter offload is used at stage 3 only; at this stage parameters stay on the device",
        _param_offload_below_stage3,
        _BELOW_3,
    ),
    InertKey(
        "zero_optimization.overlap_comm",
        "always on at stage 3: FSDP2 overlaps its collectives with compute",
        lambda cfg, value, world: value is False,
        _AT_3,
    ),
    InertKey(
        "zero_optimization.stage3_use_all_reduce_for_fetch_params",
        "FSDP2 gathers with all-gather",
        None,
        _AT_3,
    ),
    InertKey(
        "zero_optimization.memory_efficient_linear",
        "FSDP2 frees gathered weights itself; no custom linear is used",
        None,
        _AT_3,
    ),
    InertKey(
        "zero_optimization.override_module_apply", "module.apply works on the sharded module", None, _AT_3
    ),
    InertKey("zero_optimization.pipeline_loading_checkpoint", "checkpoints load shard-wise", None, _AT_3),
    InertKey("zero_optimization.log_trace_cache_warnings", "there is no trace cache", None, _AT_3),
    InertKey("zero_optimization.enable_sanity_checks", "there are no DeepSpeed sanity checks", None, _AT_3),
    InertKey(
        "zero_optimization.reduce_bucket_size",
        "at stage 3 it sizes only the all-reduce buckets of the unsharded parameters (those below "
        "stage3_param_persistence_threshold); FSDP2 reduce-scatters the sharded parameters' gradients one "
        "shard unit per collective, whatever this value",
        None,
        _AT_3,
        "acts only on unsharded parameters",
    ),
    InertKey(
        "zero_optimization.sub_group_size",
        "below stage 3 it splits only the offloaded optimizer step (offload_optimizer); without optimizer "
        "offload the local shard steps in one call (at stage 3 the step runs sub-group by sub-group)",
        _set_without_optimizer_offload,
        _BELOW_3,
    ),
    # feature sections
    InertKey(
        "data_efficiency.data_sampling.dynamic_batching",
        "no dynamic batching: every batch has the configured micro-batch size",
        _enabled,
    ),
    InertKey("eigenvalue", "no Hessian eigenvalues are computed", _enabled),
    InertKey("quantize_training", "no MoQ quantization: weights stay in the training precision", _enabled),
    InertKey("hybrid_engine", "there is no generation engine; the model trains as a plain module", _enabled),
    InertKey(
        "tensor_parallel.tp_overlap_comm",
        "the tensor-parallel all-reduces run when their result is needed (no overlap with compute)",
    ),
    InertKey(
        "tensor_parallel.tp_grain_size",
        "slices are near-equal and cut in whole attention heads, not in multiples of the grain size",
    ),
    InertKey("tensor_parallel.keep_module_on_host", "the split layers live where the model lives"),
    InertKey("tensor_parallel.vocab_parallel_ce_backend", "there is no vocabulary-parallel loss; the head's output is gathered"),
    InertKey(
        "pipeline.stages",
        "the PipelineModule's num_stages (or topology) decides the stages; DeepSpeed's engine does not read it either",
    ),
    InertKey(
        "pipeline.partition",
        "the PipelineModule's partition_method decides how layers are cut; DeepSpeed's engine does not read it either",
    ),
    InertKey(
        "pipeline.seed_layers",
        "the PipelineModule's seed_layers argument decides; DeepSpeed's engine does not read it either",
    ),
    InertKey(
        "pipeline.pipe_partitioned",
        "activations are sent whole: partitioning them acts only with tensor slicing (a topology's model axis), "
        "which shardwise's pipelines refuse",
    ),
    InertKey(
        "pipeline.grad_partitioned",
        "gradients are sent whole: partitioning them acts only with tensor slicing (a topology's model axis), "
        "which shardwise's pipelines refuse",
    ),
    *(  # the compile section: DeepCompile's own passes' settings (deepcompile, debug_log,
        # autoep_non_moe and disable act: shardwise.compilation; passes is refused: config/compile_rules.py)
        InertKey(f"compile.{key}", why)
        for key, why in (
            ("free_activation", "autograd frees each activation once its backward used it; DeepCompile's pass that frees them earlier inside its graph does not exist here"),
            ("free_activation_threshold", "a setting of DeepCompile's free_activation pass, which does not exist here"),
            ("offload_activation", "DeepCompile's activation offload pass does not exist here; activation_checkpointing.cpu_checkpointing keeps checkpointed activations in host memory"),
            ("offload_activation_pin_memory", "a setting of DeepCompile's offload_activation pass, which does not exist here"),
            ("offload_opt_states", "DeepCompile's optimizer-state offload pass does not exist here; zero_optimization.offload_optimizer offloads the optimizer state"),
            ("offload_parameters", "DeepCompile's parameter offload pass does not exist here; zero_optimization.offload_param (stage 3) offloads parameters"),
            ("double_buffer", "DeepCompile's double-buffered gathers inside its graph do not exist here; stage 3 prefetches the next blocks with FSDP2 (stage3_prefetch_bucket_size)"),
            ("symmetric_memory", "DeepCompile's symmetric-memory all-gathers do not exist here; collectives run outside the compiled blocks"),
            *(
                (f"sync_{when}_{what}", "no collective runs inside a compiled block (ZeRO gathers and reduces outside the graph), so there is none to synchronise")
                for what in ("reduce", "allgather")
                for when in ("before", "after")
            ),
            ("keep_int_input_tensors", "DeepCompile's profiling pass replays recorded inputs; shardwise runs no profiling pass, so no input is recorded"),
            ("keep_all_input_tensors", "DeepCompile's profiling pass replays recorded inputs; shardwise runs no profiling pass, so no input is recorded"),
        )
    ),
    *(
        InertKey(f"compile.{key}", "compile.disable is true (its default), so nothing is compiled at initialize; engine.compile() takes its own backend and compile_kwargs", _legacy_compile_off)
        for key in ("backend", "kwargs")
    ),
    InertKey("checkpoint.writer", "checkpoints are written by shardwise's own writer", _present),
    InertKey("checkpoint.parallel_write", "every rank writes its own files"),
    InertKey(
        "checkpoint.checkpoint_serialization", "checkpoints are written with torch.distributed.checkpoint"
    ),
)
"""Every accepted-but-ignored key, in the order they are reported."""


def _stage3_keys_below_stage3() -> tuple[InertKey, ...]:
    from shardwise.config.sections.zero import ZeroConfig

    return tuple(
        InertKey(f"zero_optimization.{name}", "a stage-3 setting; no effect at stages 0-2", None, _BELOW_3)
        for name in ZeroConfig.model_fields
        if name.startswith("stage3_")
    )


def ignored_settings(cfg: ShardwiseConfig, world_size: int = 1) -> list[IgnoredSetting]:
    """The settings of ``cfg`` that shardwise accepts without acting on them.

    Args:
        cfg: a validated config.
        world_size: the data-parallel world size (some keys matter only for some sizes).

    Example:
        >>> cfg = ShardwiseConfig(zero_optimization={"stage": 2, "round_robin_gradients": True})
        >>> [s.path for s in ignored_settings(cfg)]
        ['zero_optimization.round_robin_gradients']
    """
    found = []
    for entry in (*INERT_KEYS, *_stage3_keys_below_stage3()):
        if entry.ignored_in(cfg, world_size):
            found.append(IgnoredSetting(entry.path, _value_at(cfg, entry.path), entry.instead, entry.verdict))
    return found
