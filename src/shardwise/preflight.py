"""Preflight: the checks ``initialize`` runs that need no model, run before it builds anything.

:func:`load_checked_config` is the one way both ``initialize`` and ``shardwise config check``
read a config: :func:`shardwise.config.load_config` (sections, rules across sections, "auto",
the batch rule, ignored settings), then the configured optimizer and scheduler built once over
a one-element probe parameter with the builders ``initialize`` uses afterwards
(:func:`shardwise.optim.build_optimizer`, :func:`shardwise.schedulers.build_scheduler`). Every
check those builders make (names with did-you-mean, parameter names against the class's
signature, learning-rate and step ranges, ZeRO's untested-optimizer rule) therefore fails
as a :class:`ConfigError` naming the key before a model is touched. Warnings the builders
give (a decay that starts before the warm-up ends, ...) are added to the config's warnings
for ``config check`` to show; ``initialize`` logs them when it builds the real ones.

It sits above ``optim`` and ``schedulers`` (which ``config`` may not import) and below
``initialization`` and ``cli``. torch is imported only when the config has one of the sections.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from shardwise.config import ConfigError, ConfigErrors, ResolutionContext, ResolvedConfig, load_config
from shardwise.config.errors import KeyedValueError
from shardwise.config.model import ShardwiseConfig
from shardwise.utils.logging import logger


@contextmanager
def _captured_log() -> Iterator[list[str]]:
    """Collect the library's warnings instead of printing them (the probe is not the run)."""
    captured: list[str] = []

    class _Capture(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            if record.levelno >= logging.WARNING:
                captured.append(record.getMessage())
            return False

    capture = _Capture()
    level = logger.level
    logger.addFilter(capture)
    logger.setLevel(min(level or logging.WARNING, logging.WARNING))  # seen even when the CLI quiets the log
    try:
        yield captured
    finally:
        logger.removeFilter(capture)
        logger.setLevel(level)


def _as_config_error(exc: Exception, section: str) -> ConfigError:
    if isinstance(exc, ConfigError):
        return exc
    if isinstance(exc, KeyedValueError):
        return exc.as_config_error()
    return ConfigError(
        f"{section}.params",
        f"{type(exc).__name__} while building the {section}: {exc}",
        f"correct the {section} parameters (see the {section}'s documentation)",
    )


def zero_optimizer_error(cfg: ShardwiseConfig, optimizer: Any) -> ConfigError | None:
    """The error for an optimizer ZeRO cannot shard safely, unless the config allows it.

    ``initialize`` asks this for the optimizer it builds (config or client); the preflight for
    the config's optimizer, built on the probe.
    """
    from shardwise.optim import is_zero_supported
    from shardwise.optim.exchanging import GradientExchangingOptimizer

    if cfg.zero_stage != 0 and isinstance(optimizer, GradientExchangingOptimizer):
        return ConfigError(
            "zero_optimization.stage",
            f"{type(optimizer).__name__} averages its momentum itself with 1-bit compression after its "
            "warm-up, which needs whole gradients and whole optimizer state on every rank: ZeRO stage 0 only "
            "(DeepSpeed's 1-bit optimizers refuse ZeRO as well)",
            'set "zero_optimization": {"stage": 0}, or use Adam/AdamW to shard with ZeRO',
            value=cfg.zero_stage,
        )
    if cfg.zero_stage >= 1 and not is_zero_supported(optimizer) and not cfg.zero_allow_untested_optimizer:
        return ConfigError(
            "zero_allow_untested_optimizer",
            f"{type(optimizer).__name__} is not known to be correct on ZeRO's sharded flat tensors "
            "(optimizers with per-tensor maths, such as Lamb's trust ratio, would see shard pieces)",
            "use stage 0, an element-wise optimizer (Adam, AdamW, Adagrad, Lion), or set "
            '"zero_allow_untested_optimizer": true to run it anyway',
            value=False,
        )
    return None


def component_problems(cfg: ShardwiseConfig) -> tuple[list[ConfigError], list[str]]:
    """Build the config's optimizer and scheduler on a probe parameter.

    Returns:
        ``(errors, warnings)``: at most one error per section, and the warnings building them gave.

    Example:
        >>> cfg = load_config({"train_batch_size": 2}).config
        >>> component_problems(cfg)
        ([], [])
    """
    if cfg.optimizer is None and cfg.scheduler is None:
        return [], []
    import torch

    from shardwise.optim import build_optimizer
    from shardwise.schedulers import build_scheduler

    errors: list[ConfigError] = []
    probe = torch.nn.Parameter(torch.zeros(1))
    optimizer: object = None
    with _captured_log() as warnings:
        if cfg.optimizer is not None:
            offload = cfg.zero_optimization.offload_optimizer_device != "none"
            try:
                optimizer = build_optimizer(
                    cfg.optimizer.type, dict(cfg.optimizer.params), [probe], offload=offload
                )
            except (ValueError, TypeError) as exc:
                errors.append(_as_config_error(exc, "optimizer"))
            else:
                unsafe = zero_optimizer_error(cfg, optimizer)
                errors.extend([unsafe] if unsafe is not None else [])
        if cfg.scheduler is not None and (cfg.optimizer is None or optimizer is not None):
            # Without an optimizer section the client's optimizer is scheduled; any lr stands in for it.
            target = optimizer if optimizer is not None else torch.optim.SGD([probe], lr=1e-3)
            try:
                build_scheduler(cfg.scheduler.type, dict(cfg.scheduler.params), target)
            except (ValueError, TypeError) as exc:
                errors.append(_as_config_error(exc, "scheduler"))
    return errors, warnings


def compression_problem(cfg: ShardwiseConfig) -> ConfigError | None:
    """The first mistake in ``compression_training`` (keys, values, the ZeRO-stage rule), or None.

    Example:
        >>> cfg = load_config({"train_batch_size": 2, "compression_training": {"row_pruning": {
        ...     "shared_parameters": {"enabled": True}, "different_groups": {}}}}).config
        >>> compression_problem(cfg).key
        'compression_training.row_pruning.different_groups'
    """
    if cfg.compression_training is None:
        return None
    from shardwise.config.compression_settings import check_zero_stage, read_settings

    try:
        check_zero_stage(read_settings(cfg.compression_training), cfg.zero_stage)
    except ConfigError as error:
        return error
    return None


def tensor_parallel_problem(cfg: ShardwiseConfig) -> ConfigError | None:
    """The first mistake in ``tensor_parallel`` a model is not needed to see (an unknown
    ``preset_model``, a bad ``partition_config`` layer spec, a setting shardwise does not provide), or None.

    Example:
        >>> cfg = load_config({"train_batch_size": 2, "tensor_parallel": {"autotp_size": 2,
        ...     "preset_model": "llama9"}}).config
        >>> tensor_parallel_problem(cfg).key
        'tensor_parallel'
    """
    section = cfg.tensor_parallel
    if section.autotp_size <= 1 and section.preset_model is None and section.partition_config is None:
        return None
    from shardwise.tensor_parallel.engine_setup import check_section

    try:
        check_section(section)
    except ValueError as error:
        return ConfigError(
            "tensor_parallel",
            str(error),
            "correct the tensor_parallel section (docs/tensor-parallel.md)",
        )
    return None


def activation_checkpointing_problems(cfg: ShardwiseConfig) -> list[ConfigError]:
    """The ``activation_checkpointing`` combinations ``initialize`` would refuse (contiguous buffers
    need ``partition_activations``; a ``number_checkpoints`` given must be positive). A missing
    ``number_checkpoints`` is not one of them: it may come from ``checkpointing.configure``
    (:data:`SLOT_COUNT_NOTE`).

    Example:
        >>> cfg = load_config({"train_batch_size": 2, "activation_checkpointing": {"contiguous_memory_optimization": True}})
        >>> [e.key for e in activation_checkpointing_problems(cfg.config)]
        ['activation_checkpointing.contiguous_memory_optimization']
    """
    if not cfg.activation_checkpointing.contiguous_memory_optimization:
        return []  # the only key with a rule across keys; nothing else to import
    from shardwise.checkpointing.settings import check_section

    try:
        check_section(cfg.activation_checkpointing)
    except ConfigError as exc:
        return [exc]
    return []


SLOT_COUNT_NOTE = (
    "'activation_checkpointing.contiguous_memory_optimization' = True without number_checkpoints: the "
    "slot count must come from deepspeed.checkpointing.configure(..., num_checkpoints=N) (or set_num_layers) "
    "before the first checkpoint(), which raises without it; set activation_checkpointing.number_checkpoints "
    "to give it in the file"
)
"""The note for contiguous buffers whose slot count the config leaves to ``configure`` (as DeepSpeed's
Megatron-LM configs do); ``config check`` shows it and ``initialize`` logs it when no count is known."""


def activation_checkpointing_notes(cfg: ShardwiseConfig) -> list[str]:
    """:data:`SLOT_COUNT_NOTE` when ``cfg`` enables contiguous buffers without ``number_checkpoints``.

    Example:
        >>> cfg = load_config({"train_batch_size": 2, "activation_checkpointing": {
        ...     "partition_activations": True, "contiguous_memory_optimization": True}})
        >>> activation_checkpointing_notes(cfg.config) == [SLOT_COUNT_NOTE]
        True
    """
    section = cfg.activation_checkpointing
    if section.contiguous_memory_optimization and section.number_checkpoints is None:
        return [SLOT_COUNT_NOTE]
    return []


def load_checked_config(
    source: Any,
    *,
    world_size: int | None = None,
    overrides: Any = None,
    context: ResolutionContext | None = None,
    strict: bool = False,
) -> ResolvedConfig:
    """:func:`shardwise.config.load_config` (same arguments), then the optimizer, scheduler and
    ``compression_training`` checks.

    Raises:
        ConfigError: the first problem ``load_config`` finds, or every optimizer/scheduler/compression problem.

    Example:
        >>> try:
        ...     load_checked_config({"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lrr": 1}}})
        ... except ConfigError as err:
        ...     print(err.key, "|", err.fix[:17])
        optimizer.params.lrr | did you mean "lr"
    """
    resolved = load_config(source, world_size=world_size, overrides=overrides, context=context, strict=strict)
    errors, warnings = component_problems(resolved.config)
    compression = compression_problem(resolved.config)
    errors.extend([compression] if compression is not None else [])
    tensor_parallel = tensor_parallel_problem(resolved.config)
    errors.extend([tensor_parallel] if tensor_parallel is not None else [])
    errors += activation_checkpointing_problems(resolved.config)
    warnings += activation_checkpointing_notes(resolved.config)
    if errors:
        raise errors[0] if len(errors) == 1 else ConfigErrors(errors)
    # The builders log these themselves when initialize builds the real optimizer and scheduler;
    # they are kept (not logged twice) for `config check` to show.
    resolved.warnings.extend(warnings)
    return resolved
