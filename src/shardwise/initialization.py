"""``initialize``: read the config once and build everything, in order.

(The module is not called ``initialize.py`` because importing a submodule of that name
would shadow the ``shardwise.initialize`` function on the package.)

topology -> config (with the objects handed in resolving "auto") -> comms logger ->
activation checkpointing (``shardwise.checkpointing`` configured from its section) -> precision -> module placement and dtype -> ZeRO strategy -> scheduler -> telemetry
(monitors, timers) -> step hooks (the flops profiler...) -> checkpointer -> engine -> compile (only the
legacy ``compile.disable: false``) -> data loader.

The process layout and the ZeRO build are steps of their own, in :mod:`shardwise.startup`
(``process_layout.py``, ``zero_setup.py``); ``returned_optimizer`` stays importable from here.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeGuard

import torch
from torch import nn

from shardwise import comm
from shardwise.checkpoint.engine_io import build_checkpointer
from shardwise.checkpoint.snapshot_io import build_snapshots
from shardwise.checkpointing.settings import (
    CheckpointingSettings,
    configure_for_engine,
    describe,
    missing_slot_count,
)
from shardwise.comm.comms_logger import configure_comms_logger
from shardwise.comm.topology import Topology
from shardwise.compilation.compiler import ModelCompiler
from shardwise.config import ConfigError, ResolutionContext, ResolvedConfig
from shardwise.config.errors import AssertedValueError
from shardwise.config.model import ShardwiseConfig
from shardwise.config.sections.training import SchedulerConfig
from shardwise.engine import ShardwiseEngine
from shardwise.moe.naming import global_expert_names
from shardwise.precision.policy import PrecisionPolicy, build_precision
from shardwise.preflight import SLOT_COUNT_NOTE, load_checked_config
from shardwise.profiling.telemetry import build_telemetry
from shardwise.startup.process_layout import (
    apply_autoep,
    declared_in_config,
    merge_tp_model_init,
    split_tensor_parallel,
    start_distributed,
)
from shardwise.startup.zero_setup import place_and_build_zero, returned_optimizer
from shardwise.step_hook_factory import build_step_hooks
from shardwise.utils.logging import logger, set_log_level
from shardwise.utils.report import report_logger
from shardwise.zero.strategy import ZeroStrategy

if TYPE_CHECKING:
    from shardwise.pipe.module import PipelineModule


def _config_source(args: object, config: object, config_params: object) -> Any:
    """Where the config comes from: ``config=``, its alias ``config_params=``, or ``args``."""
    if config is None and config_params is not None:
        config = config_params
    from_args = None
    if args is not None:
        for name in ("deepspeed_config", "shardwise_config", "deepscale_config"):
            value = getattr(args, name, None)
            if value:
                if from_args is not None and value != from_args:
                    raise ConfigError(
                        "--deepspeed_config",
                        f"two different configs given on the command line ({from_args!r} and {value!r})",
                        "pass only one",
                        value=value,
                    )
                from_args = value
    if from_args is not None and config is not None:
        raise ConfigError(
            "--deepspeed_config",
            "a config was given both on the command line and to initialize(config=...)",
            "pass only one of them",
            value=from_args,
        )
    source = config if config is not None else from_args
    if source is None:
        raise ConfigError(
            "config",
            "shardwise.initialize needs a config",
            "pass config='ds_config.json' (or a dict), or --deepspeed_config on the command line",
        )
    return source


def _hidden_size(model: nn.Module) -> int | None:
    cfg = getattr(model, "config", None)
    for name in ("hidden_size", "n_embd", "d_model"):
        value = getattr(cfg, name, None)
        if isinstance(value, int):
            return value
    return None


def _client_hparams(optimizer: object) -> dict[str, Any] | None:
    if isinstance(optimizer, torch.optim.Optimizer):
        group = optimizer.param_groups[0]
        return {k: v for k, v in group.items() if k in ("lr", "betas", "eps", "weight_decay", "momentum")}
    return None


def _device() -> torch.device:
    if comm.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _build_scheduler(section: SchedulerConfig | None, client_scheduler: Any, optimizer: Any) -> Any:
    """The client's scheduler (or the one its callable builds), else the config's ``scheduler``."""
    from shardwise.schedulers import build_scheduler

    if client_scheduler is not None:
        if callable(client_scheduler) and not hasattr(client_scheduler, "step"):
            return client_scheduler(optimizer.optimizer if optimizer is not None else None)
        return client_scheduler
    if section is None or optimizer is None:
        return None
    return build_scheduler(section.type, dict(section.params), optimizer)


def initialize(
    args: argparse.Namespace | None = None,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | Callable[..., Any] | None = None,
    model_parameters: Iterable[Any] | None = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    distributed_port: int = 29500,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Any = None,
    config: Any = None,
    mesh_param: Any = None,
    config_params: Any = None,
) -> tuple[ShardwiseEngine, Any, Any, Any]:
    """Build an engine from a model and a DeepSpeed config.

    Returns ``(engine, optimizer, training_dataloader, lr_scheduler)`` like DeepSpeed.

    Example:
        >>> # engine, optimizer, loader, scheduler = shardwise.initialize(
        >>> #     model=model, model_parameters=model.parameters(), config="ds_config.json")
    """
    if model is None:
        raise _missing_model(args)
    source = merge_tp_model_init(_config_source(args, config, config_params), mpu)
    topology = start_distributed(distributed_port, dist_init_required, mpu, source, mesh_param, model)
    topology, model_parameters = apply_autoep(source, model, model_parameters, optimizer, mpu, topology)
    cfg = load_checked_config(
        source,
        context=ResolutionContext(
            # the batch rule divides by the config's sequence_parallel_size itself: then give it the dp x sp
            # ranks; an sp declared elsewhere (an mpu, register_with_transformers) leaves the dp ranks
            world_size=topology.dp_size * (topology.sp_size if declared_in_config(source)[0] else 1),
            optimizer_hparams=_client_hparams(optimizer),
            hidden_size=_hidden_size(model),
        ),
    )
    root = cfg.config
    activation_checkpointing = _configure_process(root, mpu)
    precision = build_precision(
        root.fp16, root.bf16, amp=root.amp, torch_autocast=root.torch_autocast, data_types=root.data_types
    )
    device = _device()
    model_parameters = split_tensor_parallel(root, topology, model, model_parameters, optimizer)
    if root.compression_training is not None:
        from shardwise.compression.zero_rules import prepare_for_engine

        prepare_for_engine(model, cfg, optimizer, model_parameters)
    zero_topology = topology
    if _is_pipeline(model):
        from shardwise.pipe import setup as pipe_setup

        model_parameters = pipe_setup.prepare(model, root, model_parameters)  # may re-cut it into chunks
        zero_topology = pipe_setup.norm_topology(topology, model)  # gradient norm over every stage
    model, zero_optimizer = place_and_build_zero(
        root, precision, zero_topology, device, model, model_parameters, optimizer
    )
    _synchronize_buffers(model, topology)
    scheduler = _build_scheduler(root.scheduler, lr_scheduler, zero_optimizer)
    engine = _build_engine(cfg, model, topology, precision, zero_optimizer, scheduler, device, collate_fn)
    _compile_if_configured(engine, root)
    loader = None
    if training_data is not None:
        loader = engine.deepspeed_io(training_data)
        engine.training_dataloader = loader
    _log_ready(cfg, precision, topology, activation_checkpointing)
    return engine, returned_optimizer(zero_optimizer, root.zero_stage, precision), loader, scheduler


def _missing_model(args: object) -> AssertedValueError:
    """``initialize`` without a model: DeepSpeed asserts; the error says which argument was wrong.

    A module passed positionally lands in ``args`` (``initialize(args, model, ...)``), the usual slip.
    """
    hint = ""
    if isinstance(args, nn.Module):
        hint = (
            f" (a {type(args).__name__} was passed as the first positional argument, which is `args`, "
            "the command-line namespace)"
        )
    return AssertedValueError(
        f"shardwise.initialize needs model=... (got None){hint}; fix: pass the module by keyword, "
        "initialize(model=model, config=...)"
    )


def _is_pipeline(model: nn.Module) -> TypeGuard[PipelineModule]:
    """A ``shardwise.pipe.PipelineModule`` (checked without importing the pipe package otherwise)."""
    import sys

    pipe_module = sys.modules.get("shardwise.pipe.module")
    return pipe_module is not None and isinstance(model, pipe_module.PipelineModule)


def _configure_process(root: ShardwiseConfig, mpu: object) -> CheckpointingSettings | None:
    """Process-wide settings from the config: log level, the comms logger (before the first
    broadcast, so start-up traffic is recorded too) and activation checkpointing."""
    if root.log_level:
        set_log_level(root.log_level)
    if root.comms_logger is not None:
        configure_comms_logger(root.comms_logger)
    settings = configure_for_engine(root.activation_checkpointing, mpu)
    if settings is not None and missing_slot_count(settings) is not None:
        logger.warning(SLOT_COUNT_NOTE)  # no configure(num_checkpoints=N) yet: a later one may give it
    return settings


def _synchronize_buffers(model: nn.Module, topology: Topology) -> None:
    """Every rank of the model replica's group (data x sequence parallel, the group ZeRO shards over)
    takes the first rank's buffers; expanded views that differ are an error. Buffers of
    expert-parallel experts (each rank holds other experts) come from the first rank of their
    expert-data-parallel group instead."""
    experts = global_expert_names(model)
    if experts and topology.size_of("edp") > 1:
        edp = topology.group_of("edp")
        for name, b in model.named_buffers():
            if name in experts:
                comm.broadcast_into(b, src=comm.group_source_rank(edp), group=edp)
    if topology.shard_size == 1:
        return  # one rank holds this replica (slice): nothing to agree on
    source = comm.group_source_rank(topology.shard_group)
    buffers = [(name, b) for name, b in model.named_buffers() if name not in experts]
    unequal = [
        name for name, b in buffers if not comm.broadcast_into(b, src=source, group=topology.shard_group)
    ]
    # Only expanded buffers can fail, and the model's structure is the same on every rank: the
    # agreement (every rank stops, not just the one that differs) costs a collective only then.
    shared = any(not b.is_contiguous() and 0 in b.stride() for _, b in buffers)
    if shared and comm.all_reduce_max_flag(bool(unequal), group=topology.shard_group):
        raise ValueError(
            f"buffer(s) {unequal or '(on another rank)'} are expanded views (their elements share memory) "
            f"and differ from rank {source}'s, so they cannot be made equal on every rank; register "
            "contiguous buffers (`.contiguous()` or `.clone()` before register_buffer), or plain attributes "
            "for derived data"
        )


def _build_engine(
    cfg: ResolvedConfig,
    model: nn.Module,
    topology: Topology,
    precision: PrecisionPolicy,
    zero_optimizer: ZeroStrategy | None,
    scheduler: object,
    device: torch.device,
    collate_fn: object,
) -> ShardwiseEngine:
    """Telemetry, step hooks and the checkpointer, then the engine with every part injected."""
    telemetry = build_telemetry(
        cfg,
        device,
        topology.world_rank,
        topology.world_size,
        dp_size=topology.dp_size,
        mp_size=topology.mp_size,
        precision=precision,
    )
    engine_class = ShardwiseEngine
    if _is_pipeline(model):
        from shardwise.pipe.engine import PipelineEngine

        engine_class = PipelineEngine  # train_batch / eval_batch over the pipeline's stages
    return engine_class(
        model,
        cfg,
        topology,
        precision,
        zero_optimizer,
        scheduler,
        device,
        collate_fn,
        telemetry=telemetry,
        step_hooks=build_step_hooks(cfg.config, model, rank=topology.world_rank, telemetry=telemetry),
        checkpointer=build_checkpointer(cfg.config.checkpoint),
        snapshots=build_snapshots(cfg.config.checkpoint),
        compiler=ModelCompiler(cfg.config.compile),
    )


def _compile_if_configured(engine: ShardwiseEngine, root: ShardwiseConfig) -> None:
    """``compile.disable: false``, the pre-0.17 spelling: DeepSpeed then compiled the model itself
    (at its first forward) with ``compile.backend`` and ``compile.kwargs``; so does this, per block."""
    section = root.compile
    if section.disable:
        return
    logger.info("compile.disable is false: compiling the model (backend %r)", section.backend)
    engine.compile(backend=section.backend, compile_kwargs=section.kwargs)


def _log_ready(
    cfg: ResolvedConfig,
    precision: PrecisionPolicy,
    topology: Topology,
    activation_checkpointing: CheckpointingSettings | None,
) -> None:
    """The start-up lines: the engine's shape, the whole config with ``dump_state``, activation checkpointing."""
    root = cfg.config
    logger.info(
        "engine ready: ZeRO stage %d, %s, batch %d = %d x %d x %d ranks",
        root.zero_stage,
        precision.name,
        cfg.batch.train_batch_size,
        cfg.batch.micro_batch_per_gpu,
        cfg.batch.gradient_accumulation_steps,
        topology.dp_size,
    )
    if root.dump_state:  # DeepSpeed prints its whole configuration at start-up with dump_state
        report_logger().info("configuration (dump_state):\n%s", dump_state_text(cfg))
    if activation_checkpointing is not None:
        report_logger().info("%s", describe(activation_checkpointing))  # the config asked for it


def dump_state_text(resolved: Any) -> str:
    """Every resolved key and its value, one ``key = value`` per line (``dump_state: true``)."""
    flat = resolved.flat()
    width = max((len(k) for k in flat), default=0)
    return "\n".join(f"  {key:<{width}} = {value!r}" for key, value in sorted(flat.items()))


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--deepspeed``, ``--deepspeed_config`` (and ``--shardwise_config``) to a parser."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed-compatible configuration (shardwise)")
    group.add_argument(
        "--deepspeed", default=False, action="store_true", help="accepted for compatibility; has no effect"
    )
    group.add_argument("--deepspeed_config", default=None, type=str, help="ds_config.json path")
    group.add_argument("--shardwise_config", default=None, type=str, help="alias of --deepspeed_config")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser
