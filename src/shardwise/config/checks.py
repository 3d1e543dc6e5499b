"""Rules that span sections, checked after each section validated on its own.

Each rule returns ``ConfigError``s naming the key that should change, so a user of
``fp16`` + ``bf16`` sees ``'bf16.enabled'`` and the way out, not a pydantic dump.
"""

from __future__ import annotations

from shardwise.config.compile_rules import compile_errors
from shardwise.config.errors import AssertedConfigError, ConfigError
from shardwise.config.loss_scale_rules import dynamic_scale_settings
from shardwise.config.model import ShardwiseConfig


def _precision_rules(cfg: ShardwiseConfig) -> list[ConfigError]:
    errors = []
    if cfg.fp16.enabled and cfg.bf16.enabled:
        errors.append(
            ConfigError(
                "bf16.enabled",
                "fp16 and bf16 cannot both be enabled",
                "pick one; bf16 needs no loss scaling and is the safer choice",
                value=True,
            )
        )
    if cfg.amp.enabled and (cfg.fp16.enabled or cfg.bf16.enabled):
        errors.append(
            ConfigError(
                "amp.enabled",
                "amp cannot be combined with fp16 or bf16",
                "keep only one precision section enabled",
                value=True,
            )
        )
    enabled = cfg.precision
    if cfg.data_types.param_dtype is not None and cfg.data_types.param_dtype != enabled:
        errors.append(
            ConfigError(
                "data_types.param_dtype",
                f"must match the enabled precision ({enabled!r})",
                "remove param_dtype or make it match",
                value=cfg.data_types.param_dtype,
            )
        )
    if cfg.bf16.bf16_optimizer_states and not cfg.bf16.bf16_master_weights_and_grads:
        errors.append(
            ConfigError(
                "bf16.bf16_optimizer_states",
                "needs bf16.bf16_master_weights_and_grads=true",
                "enable bf16_master_weights_and_grads or drop bf16_optimizer_states",
                value=True,
            )
        )
    return errors


def _loss_scaling_rules(cfg: ShardwiseConfig) -> list[ConfigError]:
    """The fp16 scaler's settings, checked by the scaler's own rules and only where they are used.

    DeepSpeed checks ``loss_scale_window``, ``hysteresis`` and ``min_loss_scale`` only
    under dynamic loss scaling; a static scale or a run without fp16 math ignores them.
    """
    if not (cfg.fp16_loss_scaling and cfg.fp16.dynamic):
        return []
    fp16 = cfg.fp16
    try:
        dynamic_scale_settings(
            fp16.initial_scale_power,
            fp16.loss_scale_window,
            fp16.hysteresis,
            fp16.consecutive_hysteresis,
            fp16.min_loss_scale,
        )
    except ConfigError as exc:
        return [exc]
    return []


def _communication_rules(cfg: ShardwiseConfig) -> list[ConfigError]:
    errors = []
    zero = cfg.zero_optimization
    if zero.stage == 2 and zero.reduce_scatter and cfg.gradient_allreduce_op == "mean":
        if cfg.prescale_gradients:
            errors.append(
                ConfigError(
                    "prescale_gradients",
                    "is not supported with zero_optimization.stage=2 and reduce_scatter=true",
                    "set prescale_gradients to false (the averaged result is the same)",
                    value=True,
                )
            )
        if cfg.gradient_predivide_factor != 1.0:
            errors.append(
                ConfigError(
                    "gradient_predivide_factor",
                    "must be 1.0 with stage 2 and reduce_scatter=true",
                    "remove it, or set zero_optimization.reduce_scatter to false",
                    value=cfg.gradient_predivide_factor,
                )
            )
    if cfg.gradient_allreduce_op == "sum":
        # DeepSpeed refuses these three combinations too: each reduces gradients its own way, averaging
        for rule, refused in (
            ("is not supported with ZeRO stage 3", zero.stage == 3),
            ("is not supported with ZenFlow (zero_optimization.zenflow)", zero.zenflow is not None),
            ("is not supported with DeepCompile (compile.deepcompile)", cfg.compile.deepcompile),
        ):
            if refused:
                errors.append(ConfigError("gradient_allreduce_op", f"'sum' {rule}", "use 'mean'", value="sum"))
    if zero.stage in (1, 2) and zero.allgather_bucket_size % 2:
        # DeepSpeed refuses an odd bucket at stages 1-2 (its 16-bit all-gather chunks must start 4-byte
        # aligned). shardwise would run it, but a config that passes here must also run on DeepSpeed.
        errors.append(
            AssertedConfigError(
                "zero_optimization.allgather_bucket_size",
                "allgather_bucket_size must be a multiple of nccl_start_alignment_factor (2) at stages 1-2",
                f"use an even size, e.g. {zero.allgather_bucket_size + 1} (16-bit chunks start 4-byte aligned)",
                value=zero.allgather_bucket_size,
            )
        )
    if not zero.compute_grad_norm and cfg.gradient_clipping > 0:
        errors.append(
            ConfigError(
                "zero_optimization.compute_grad_norm",
                f"false needs gradient_clipping=0 (clipping is {cfg.gradient_clipping})",
                "set gradient_clipping to 0 or compute_grad_norm to true",
                value=False,
            )
        )
    return errors


def _unsupported_rules(cfg: ShardwiseConfig) -> list[ConfigError]:
    errors = []
    if cfg.zero_optimization.offload_optimizer_device != "none" and cfg.zero_stage == 0:
        errors.append(
            ConfigError(
                "zero_optimization.offload_optimizer.device",
                "optimizer offload needs ZeRO stage 1, 2 or 3 (stage 0 keeps no optimizer partition to offload)",
                "set zero_optimization.stage to 1 or more, or remove the offload_optimizer block",
                value=cfg.zero_optimization.offload_optimizer_device,
            )
        )
    if cfg.nebula is not None and cfg.nebula.enabled:
        errors.append(
            ConfigError(
                "nebula.enabled",
                "the Nebula checkpoint service is not available",
                "remove the block; the 'checkpoint' section's async_save gives non-blocking saves",
                value=True,
            )
        )
    if not cfg.managed_gradient_accumulation and cfg.zero_optimization.stage < 2 and cfg.zero_optimization.overlap_comm:
        errors.append(
            AssertedConfigError(
                "zero_optimization.overlap_comm",
                "managed_gradient_accumulation=False supports ZeRO overlap_comm only with ZeRO stage 2 or 3: at "
                "stages 0-1 the reduction waits for step(), so nothing overlaps backward (DeepSpeed refuses it too)",
                "remove overlap_comm, or use stage 2",
                value=True,
            )
        )
    if not cfg.managed_gradient_accumulation and cfg.compile.deepcompile:
        errors.append(
            ConfigError(
                "managed_gradient_accumulation",
                "false is not supported with DeepCompile (compile.deepcompile), as in DeepSpeed",
                "remove the key (or set it to true), or turn compile.deepcompile off",
                value=False,
            )
        )
    if cfg.zero_optimization.mics_shard_size > 0:
        errors.append(
            ConfigError(
                "zero_optimization.mics_shard_size",
                "MiCS hierarchical sharding is not supported",
                "remove mics_shard_size and mics_hierarchical_params_gather",
                value=cfg.zero_optimization.mics_shard_size,
            )
        )
    return errors


def _snapshot_rules(cfg: ShardwiseConfig) -> list[ConfigError]:
    """Periodic snapshots need somewhere to go."""
    section = cfg.checkpoint
    if section.snapshot_interval > 0 and not section.snapshot_dir:
        return [
            ConfigError(
                "checkpoint.snapshot_dir",
                f"snapshot_interval {section.snapshot_interval} needs a directory for the snapshots",
                'set "checkpoint": {"snapshot_dir": "<a directory every rank can write>"} (it may be the '
                "directory you pass to load_checkpoint), or set snapshot_interval to 0",
                value=section.snapshot_dir,
            )
        ]
    return []


def cross_section_errors(cfg: ShardwiseConfig) -> list[ConfigError]:
    """Every cross-section problem of a config whose sections are individually valid."""
    return [
        *_precision_rules(cfg),
        *_loss_scaling_rules(cfg),
        *_communication_rules(cfg),
        *_unsupported_rules(cfg),
        *_snapshot_rules(cfg),
        *compile_errors(cfg),
    ]
