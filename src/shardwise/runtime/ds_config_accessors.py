"""DeepSpeed's engine accessors that read the config (everything but ``zero_*``, which is in
:mod:`shardwise.runtime.ds_zero_accessors`): optimizer and scheduler, precision, flops profiler,
autotuning, checkpoint, data efficiency, torch autocast, compile passes, aio, tensor parallel.

Each returns what DeepSpeed 0.19.8's ``DeepSpeedEngine`` returns for the same config, read from the
resolved config (``engine._config``). Where DeepSpeed returns a plain dict (``aio_config``,
``data_efficiency_config``, ``dynamic_loss_scale_args``) so does shardwise, with DeepSpeed's keys; where
it returns its own config object, the docstring names what shardwise returns instead. Whether a key
was written (DeepSpeed answers None or copies the written keys then) is pydantic's
``model_fields_set``. The reference test, ``tests/unit/runtime/test_ds_config_accessors.py``, compares
every accessor with DeepSpeed's recorded values and names each deliberate difference.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from shardwise.config.sections.data_efficiency import DataEfficiencyConfig
from shardwise.config.sections.features import TensorParallelConfig
from shardwise.runtime.ds_zero_accessors import DeepSpeedZeroAccessors

# DeepSpeed lower-cases ``optimizer.type`` when it names one of its own optimizers.
DEEPSPEED_OPTIMIZER_NAMES = frozenset(
    {"adagrad", "adam", "adamw", "lamb", "muadam", "muadamw", "musgd", "lion", "muon"}
)
# DeepSpeed's default ``torch_autocast.lower_precision_safe_modules``.
DEFAULT_LOWER_PRECISION_SAFE_MODULES = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)
_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_AUTOCAST_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def _written(model: Any, exclude: frozenset[str] = frozenset()) -> dict[str, Any]:
    """The keys a section model was given, as written (DeepSpeed copies these into its dicts)."""
    return {k: v for k, v in model.model_dump(exclude_unset=True).items() if k not in exclude}


def data_efficiency_dict(section: DataEfficiencyConfig, train_batch: int, micro_batch: int) -> dict[str, Any]:
    """``data_efficiency`` as DeepSpeed's ``DeepSpeedConfig.data_efficiency_config`` dict: every written
    key plus the defaults DeepSpeed fills; an enabled ``random_ltd`` also gets the batch sizes the
    engine adds to it (``global_batch_size``, ``micro_batch_size``)."""
    sampling = section.data_sampling
    curriculum = sampling.curriculum_learning
    batching = sampling.dynamic_batching
    curriculum_out: dict[str, Any] = {"enabled": curriculum.enabled}
    if curriculum.enabled:
        curriculum_out.update(_written(curriculum, frozenset({"enabled"})))
    batching_out = _written(batching)
    batching_out.update(
        enabled=batching.enabled,
        lr_scaling_method=batching.lr_scaling_method,
        min_batch_size=batching.min_batch_size,
        max_batch_size=batching.max_batch_size,
        sequence_picking_order=batching.sequence_picking_order,
        verbose=batching.verbose,
    )
    if batching.enabled:
        batching_out["max_tokens"] = batching.max_tokens
    sampling_out = _written(sampling)
    sampling_out.update(
        enabled=sampling.enabled,
        num_epochs=sampling.num_epochs,
        num_workers=sampling.num_workers,
        pin_memory=sampling.pin_memory,
        curriculum_learning=curriculum_out,
        dynamic_batching=batching_out,
    )
    ltd = section.data_routing.random_ltd
    ltd_out: dict[str, Any] = {"enabled": False, "layer_token_lr_schedule": {"enabled": False}}
    if ltd.enabled:
        ltd_out.update(_written(ltd, frozenset({"enabled"})), enabled=True)
        ltd_out.update(global_batch_size=train_batch, micro_batch_size=micro_batch)
    return {
        "enabled": section.enabled,
        "seed": section.seed,
        "data_sampling": sampling_out,
        "data_routing": {"enabled": section.data_routing.enabled, "random_ltd": ltd_out},
    }


class DeepSpeedConfigAccessors(DeepSpeedZeroAccessors):
    """Mixed into :class:`~shardwise.engine.ShardwiseEngine` (needs ``_config`` and ``optimizer``, the
    ZeRO strategy whose ``optimizer`` is the torch optimizer)."""

    _config: Any
    optimizer: Any

    @property
    def _root(self) -> Any:
        return self._config.config

    # ------------------------------------------------------------------ top-level switches
    def wall_clock_breakdown(self) -> bool:
        """``wall_clock_breakdown``, also on when the flops profiler is (as in DeepSpeed)."""
        return bool(self._root.wall_clock_breakdown or self._root.flops_profiler.enabled)

    def memory_breakdown(self) -> bool:
        """``memory_breakdown``."""
        return bool(self._root.memory_breakdown)

    def dump_state(self) -> bool:
        """``dump_state``."""
        return bool(self._root.dump_state)

    def dataloader_drop_last(self) -> bool:
        """``dataloader_drop_last``."""
        return bool(self._root.dataloader_drop_last)

    def gradient_predivide_factor(self) -> float:
        """``gradient_predivide_factor``."""
        return float(self._root.gradient_predivide_factor)

    def postscale_gradients(self) -> bool:
        """``not prescale_gradients``."""
        return not self._root.prescale_gradients

    # ------------------------------------------------------------------ optimizer and scheduler
    def optimizer_name(self) -> str | None:
        """``optimizer.type`` (lower-cased when it names a DeepSpeed optimizer); with a client
        optimizer, its class name; None without an optimizer."""
        section = self._root.optimizer
        if section is not None:
            name: str = section.type
            return name.lower() if name.lower() in DEEPSPEED_OPTIMIZER_NAMES else name
        return None if self.optimizer is None else type(self.optimizer.optimizer).__name__

    def optimizer_params(self) -> dict[str, Any] | None:
        """``optimizer.params`` as written; None when the config has no ``optimizer.params``."""
        section = self._root.optimizer
        if section is None or "params" not in section.model_fields_set:
            return None
        params: dict[str, Any] = section.params
        return params

    def optimizer_legacy_fusion(self) -> bool:
        """``optimizer.legacy_fusion`` (False without it)."""
        section = self._root.optimizer
        return False if section is None else bool(section.legacy_fusion)

    def scheduler_name(self) -> str | None:
        """``scheduler.type`` as written; None without a scheduler section."""
        section = self._root.scheduler
        return None if section is None else str(section.type)

    def scheduler_params(self) -> dict[str, Any] | None:
        """``scheduler.params`` as written; None when the config has no ``scheduler.params``."""
        section = self._root.scheduler
        if section is None or "params" not in section.model_fields_set:
            return None
        params: dict[str, Any] = section.params
        return params

    # ------------------------------------------------------------------ precision
    def dynamic_loss_scale(self) -> bool:
        """True when ``fp16.loss_scale`` is 0 (whether or not fp16 is enabled, as in DeepSpeed)."""
        return bool(self._root.fp16.loss_scale == 0)

    def initial_dynamic_scale(self) -> int:
        """``2 ** fp16.initial_scale_power``."""
        return int(2**self._root.fp16.initial_scale_power)

    def dynamic_loss_scale_args(self) -> dict[str, Any]:
        """The ``fp16`` dynamic-scaling settings under DeepSpeed's loss-scaler keys (``init_scale``,
        ``scale_window``, ``delayed_shift``, ``consecutive_hysteresis``, ``min_scale``)."""
        fp16 = self._root.fp16
        minimum = fp16.min_loss_scale
        return {
            "init_scale": 2**fp16.initial_scale_power,
            "scale_window": fp16.loss_scale_window,
            "delayed_shift": fp16.hysteresis,
            "consecutive_hysteresis": fp16.consecutive_hysteresis,
            "min_scale": int(minimum) if float(minimum).is_integer() else minimum,
        }

    def fp16_auto_cast(self) -> bool:
        """``fp16.auto_cast``."""
        return bool(self._root.fp16.auto_cast)

    def fp16_master_weights_and_gradients(self) -> bool:
        """``fp16.fp16_master_weights_and_grads``."""
        return bool(self._root.fp16.fp16_master_weights_and_grads)

    def bf16_master_weights_and_gradients(self) -> bool:
        """``bf16.bf16_master_weights_and_grads``."""
        return bool(self._root.bf16.bf16_master_weights_and_grads)

    def bf16_optimizer_states(self) -> bool:
        """``bf16.bf16_optimizer_states``."""
        return bool(self._root.bf16.bf16_optimizer_states)

    @property
    def communication_data_type(self) -> torch.dtype:
        """``communication_data_type`` as a torch dtype; unset: fp16, bf16 or fp32 after the precision
        (DeepSpeed's property). Read-only here: setting it raises (see the setter)."""
        name = self._root.communication_data_type
        if name is not None:
            return _DTYPES[name]
        return self._model_dtype()

    @communication_data_type.setter
    def communication_data_type(self, value: Any) -> None:
        raise AttributeError(
            f"engine.communication_data_type = {value!r}: the gradient wire dtype is fixed when initialize() "
            "builds the ZeRO strategy, so changing it afterwards would be ignored; set "
            '\'communication_data_type\' ("fp16", "bf16" or "fp32") in the config instead'
        )

    def _model_dtype(self) -> torch.dtype:
        """fp16 or bf16 when enabled, else fp32 (DeepSpeed's model dtype)."""
        return (
            torch.float16
            if self._root.fp16.enabled
            else torch.bfloat16
            if self._root.bf16.enabled
            else torch.float32
        )

    def get_data_types(self) -> tuple[torch.dtype, torch.dtype]:
        """``(model dtype, gradient-accumulation dtype)``: the model's from fp16/bf16, the second from
        ``data_types.grad_accum_dtype`` (unset: the model's)."""
        model = self._model_dtype()
        accum = self._root.data_types.grad_accum_dtype
        return model, model if accum is None else _DTYPES[accum]

    def torch_autocast_enabled(self) -> bool:
        """``torch_autocast.enabled``."""
        return bool(self._root.torch_autocast.enabled)

    def torch_autocast_dtype(self) -> torch.dtype | None:
        """``torch_autocast.dtype`` as a torch dtype; None when the section does not write one."""
        section = self._root.torch_autocast
        return _AUTOCAST_DTYPES[section.dtype] if "dtype" in section.model_fields_set else None

    def torch_autocast_lower_precision_safe_modules(self) -> list[str]:
        """``torch_autocast.lower_precision_safe_modules``; unset: DeepSpeed's default (torch's Linear and
        Conv1d/2d/3d by qualified name). Recorded, not acted on: autocast applies torch's own per-op rules."""
        names: list[str] | None = self._root.torch_autocast.lower_precision_safe_modules
        if names is None:
            return [f"{cls.__module__}.{cls.__name__}" for cls in DEFAULT_LOWER_PRECISION_SAFE_MODULES]
        return names

    # ------------------------------------------------------------------ flops profiler and autotuning
    def flops_profiler_enabled(self) -> bool:
        """``flops_profiler.enabled``, also on when autotuning is."""
        return bool(self._root.flops_profiler.enabled or self._root.autotuning.enabled)

    def flops_profiler_recompute_fwd_factor(self) -> float:
        """``flops_profiler.recompute_fwd_factor``."""
        return float(self._root.flops_profiler.recompute_fwd_factor)

    def flops_profiler_profile_step(self) -> int:
        """``flops_profiler.profile_step``; under autotuning, ``autotuning.start_profile_step``."""
        if self._root.autotuning.enabled:
            return int(self._root.autotuning.start_profile_step)
        return int(self._root.flops_profiler.profile_step)

    def flops_profiler_module_depth(self) -> int:
        """``flops_profiler.module_depth`` (-1: every depth)."""
        return int(self._root.flops_profiler.module_depth)

    def flops_profiler_top_modules(self) -> int:
        """``flops_profiler.top_modules``."""
        return int(self._root.flops_profiler.top_modules)

    def flops_profiler_detailed(self) -> bool:
        """``flops_profiler.detailed``; False under autotuning."""
        return False if self._root.autotuning.enabled else bool(self._root.flops_profiler.detailed)

    def flops_profiler_output_file(self) -> str | None:
        """``flops_profiler.output_file`` (None: standard output)."""
        name: str | None = self._root.flops_profiler.output_file
        return name

    def autotuning_enabled(self) -> bool:
        """``autotuning.enabled``."""
        return bool(self._root.autotuning.enabled)

    def autotuning_start_profile_step(self) -> int:
        """``autotuning.start_profile_step``."""
        return int(self._root.autotuning.start_profile_step)

    def autotuning_end_profile_step(self) -> int:
        """``autotuning.end_profile_step``."""
        return int(self._root.autotuning.end_profile_step)

    def autotuning_metric(self) -> str:
        """``autotuning.metric``."""
        return str(self._root.autotuning.metric)

    def autotuning_metric_path(self) -> str:
        """``autotuning.metric_path``; unset: ``autotuning_metric.json`` in the working directory."""
        path = self._root.autotuning.metric_path
        return path or os.path.join(os.getcwd(), "autotuning_metric.json")

    def autotuning_model_info_path(self) -> str:
        """``autotuning.model_info_path``; unset: ``autotuning_model_info.json`` in the working directory."""
        path = self._root.autotuning.model_info_path
        return path or os.path.join(os.getcwd(), "autotuning_model_info.json")

    def autotuning_profile_model_info(self) -> bool | None:
        """``autotuning.model_info.profile`` when autotuning is on; False when it is off; None when it is
        on without a ``model_info`` block (DeepSpeed's ``and`` chain)."""
        section = self._root.autotuning
        if not section.enabled:
            return False
        if "model_info" not in section.model_fields_set:
            return None
        return bool(section.model_info.profile)

    # ------------------------------------------------------------------ checkpoint
    def checkpoint_tag_validation_enabled(self) -> bool:
        """``checkpoint.tag_validation`` is not Ignore."""
        return bool(self._root.checkpoint.tag_validation != "Ignore")

    def checkpoint_tag_validation_fail(self) -> bool:
        """``checkpoint.tag_validation`` is Fail."""
        return bool(self._root.checkpoint.tag_validation == "Fail")

    def checkpoint_serialization_enabled(self) -> bool:
        """``checkpoint.checkpoint_serialization``."""
        return bool(self._root.checkpoint.checkpoint_serialization)

    def checkpoint_writer_enabled(self) -> bool:
        """True when the config has a ``checkpoint.writer`` block."""
        return self._root.checkpoint.writer is not None

    def load_universal_checkpoint(self) -> bool:
        """``checkpoint.load_universal``."""
        return bool(self._root.checkpoint.load_universal)

    def use_node_local_storage(self) -> bool:
        """``checkpoint.use_node_local_storage``."""
        return bool(self._root.checkpoint.use_node_local_storage)

    # ------------------------------------------------------------------ data efficiency
    def data_efficiency_enabled(self) -> bool:
        """``data_efficiency.enabled``."""
        return bool(self._root.data_efficiency.enabled)

    def data_efficiency_config(self) -> dict[str, Any]:
        """``data_efficiency`` as DeepSpeed's dict (:func:`data_efficiency_dict`); a fresh dict per call."""
        batch = self._config.batch
        return data_efficiency_dict(
            self._root.data_efficiency, batch.train_batch_size, batch.micro_batch_per_gpu
        )

    def data_sampling_config(self) -> dict[str, Any]:
        """``data_efficiency.data_sampling`` as DeepSpeed's dict."""
        sampling: dict[str, Any] = self.data_efficiency_config()["data_sampling"]
        return sampling

    def data_sampling_enabled(self) -> bool:
        """``data_efficiency.data_sampling.enabled``."""
        return bool(self._root.data_efficiency.data_sampling.enabled)

    def curriculum_learning_config(self) -> dict[str, Any]:
        """``data_efficiency.data_sampling.curriculum_learning`` as DeepSpeed's dict."""
        curriculum: dict[str, Any] = self.data_sampling_config()["curriculum_learning"]
        return curriculum

    def curriculum_learning_enabled(self) -> bool:
        """``data_efficiency.data_sampling.curriculum_learning.enabled``."""
        return bool(self._root.data_efficiency.data_sampling.curriculum_learning.enabled)

    def random_ltd_config(self) -> dict[str, Any]:
        """``data_efficiency.data_routing.random_ltd`` as DeepSpeed's dict."""
        ltd: dict[str, Any] = self.data_efficiency_config()["data_routing"]["random_ltd"]
        return ltd

    def random_ltd_enabled(self) -> bool:
        """``data_efficiency.data_routing.random_ltd.enabled``."""
        return bool(self._root.data_efficiency.data_routing.random_ltd.enabled)

    # ------------------------------------------------------------------ other sections
    def aio_config(self) -> dict[str, Any]:
        """The ``aio`` section as DeepSpeed's dict (block_size, queue_depth, intra_op_parallelism,
        single_submit, overlap_events, use_gds)."""
        section: dict[str, Any] = self._root.aio.model_dump()
        return section

    def tensor_parallel_config(self) -> TensorParallelConfig:
        """The ``tensor_parallel`` section: shardwise's model, not DeepSpeed's ``TPTrainingConfig``. Its
        fields carry DeepSpeed's names except two: ``dtype`` is None unless written (DeepSpeed:
        ``torch.float16``; shardwise keeps the model's dtype) and the nested ``tp`` block is a dict plus a
        top-level ``tp_grain_size`` (DeepSpeed: a ``tensor_parallel`` ``TPConfig`` object)."""
        section: TensorParallelConfig = self._root.tensor_parallel
        return section

    def _compile_passes(self) -> list[str]:
        passes: list[str] | None = self._root.compile.passes
        return passes or []

    def compile_autosp(self) -> bool:
        """True when ``compile.passes`` names ``autosp``."""
        return "autosp" in self._compile_passes()

    def compile_autotp(self) -> bool:
        """True when ``compile.passes`` names ``autotp``."""
        return "autotp" in self._compile_passes()

    def compile_zero_optimization_stage(self) -> bool:
        """True when ``compile.passes`` names ``z1`` or ``z3``; False without ``passes`` (DeepSpeed 0.19.8
        raises TypeError then)."""
        passes = self._compile_passes()
        return "z1" in passes or "z3" in passes
