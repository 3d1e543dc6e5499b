"""``initialize``: read the config once and build everything, in order.

(The module is not called ``initialize.py`` because importing a submodule of that name
would shadow the ``shardwise.initialize`` function on the package.)

topology -> config (with the objects handed in resolving "auto") -> comms logger ->
activation checkpointing (``shardwise.checkpointing`` configured from its section) -> precision -> module placement and dtype -> ZeRO strategy -> scheduler -> telemetry
(monitors, timers) -> step hooks (the flops profiler...) -> checkpointer -> engine -> data loader.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from shardwise import comm
from shardwise.checkpoint.engine_io import build_checkpointer
from shardwise.checkpointing.settings import (
    CheckpointingSettings,
    configure_for_engine,
    describe,
    missing_slot_count,
)
from shardwise.comm import mesh
from shardwise.comm.comms_logger import configure_comms_logger
from shardwise.comm.groups import set_topology
from shardwise.comm.topology import Topology, build_topology
from shardwise.config import ConfigError, ResolutionContext, ResolvedConfig
from shardwise.config.loading import read_config_source
from shardwise.config.model import ShardwiseConfig
from shardwise.config.sections.training import OptimizerConfig, SchedulerConfig
from shardwise.engine import ShardwiseEngine
from shardwise.moe.autoep import autoep_settings, convert_model, repoint
from shardwise.moe.declare import declare_expert_parallelism, expert_parallel_degree
from shardwise.moe.naming import global_expert_names
from shardwise.optim.client import adopt_client_optimizer, client_param_groups
from shardwise.precision.policy import PrecisionPolicy, build_precision
from shardwise.preflight import SLOT_COUNT_NOTE, load_checked_config, zero_optimizer_error
from shardwise.profiling.telemetry import build_telemetry
from shardwise.step_hook_factory import build_step_hooks
from shardwise.utils.logging import logger, set_log_level
from shardwise.utils.report import report_logger
from shardwise.zero.strategy import ZeroStrategy


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


def _user_param_groups(
    model: nn.Module, model_parameters: Any, client_optimizer: Any
) -> list[dict[str, Any]]:
    if isinstance(client_optimizer, torch.optim.Optimizer):
        return client_param_groups(client_optimizer)  # one per client group: adopted back in place
    if model_parameters is None:
        return [{"params": [p for p in model.parameters() if p.requires_grad]}]
    items = list(model_parameters)
    if items and isinstance(items[0], dict):
        return [{**g, "params": list(g["params"])} for g in items if list(g["params"])]
    return [{"params": items}]


def _optimizer_factory(
    section: OptimizerConfig | None, offload: bool, client_optimizer: object
) -> Callable[[list[dict[str, Any]]], Any] | None:
    """How to build the inner optimizer over the tensors ZeRO hands it (masters/shards):
    the client's (``optimizer=``), else the config's ``optimizer`` section (``section``;
    ``offload``: ZeRO optimizer offload is on).

    A client optimizer object is not rebuilt: its param groups are re-pointed in place
    (:func:`shardwise.optim.client.adopt_client_optimizer`), so it is the one that steps and
    a scheduler built on it drives the real learning rate.
    """
    from shardwise.optim import build_optimizer

    if isinstance(client_optimizer, torch.optim.Optimizer):
        client = client_optimizer
        return lambda groups: adopt_client_optimizer(client, groups)
    if callable(client_optimizer):
        return lambda groups: client_optimizer(groups)
    if section is not None:
        spec = section
        return lambda groups: build_optimizer(spec.type, dict(spec.params), groups, offload=offload)
    return None


def _check_zero_optimizer(root: ShardwiseConfig, optimizer: torch.optim.Optimizer) -> None:
    """``zero_allow_untested_optimizer``: refuse optimizers not known to work on shards."""
    error = zero_optimizer_error(root, optimizer)
    if error is not None:
        raise error


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


def _place_and_build_zero(
    root: ShardwiseConfig,
    precision: PrecisionPolicy,
    topology: Topology,
    device: torch.device,
    model: nn.Module,
    model_parameters: object,
    client_optimizer: object,
) -> tuple[nn.Module, ZeroStrategy | None]:
    """Place (stage 3: shard) the model and build the ZeRO optimizer, handing each builder the
    sections and values it reads. Returns the model and the optimizer (None without one)."""
    from shardwise.zero.factory import (
        build_zero_optimizer,
        communication_dtype,
        prepare_module,
        reduction_factors,
    )

    zero, aio = root.zero_optimization, root.aio
    comm_dtype = communication_dtype(root.communication_data_type)
    prepared = prepare_module(  # stage 3: sharded in place, with its record
        model,
        zero=zero,
        aio=aio,
        comm_dtype=comm_dtype,
        precision=precision,
        topology=topology,
        device=device,
    )
    offload = zero.offload_optimizer_device != "none"
    factory = _optimizer_factory(root.optimizer, offload, client_optimizer)
    if factory is None:
        return prepared.module, None

    def checked(groups: list[dict[str, object]]) -> Any:
        inner = factory(groups)
        _check_zero_optimizer(root, inner)
        return inner

    reduction = reduction_factors(
        topology.dp_size,
        allreduce_op=root.gradient_allreduce_op,
        prescale=root.prescale_gradients,
        predivide_factor=root.gradient_predivide_factor,
    )
    zero_optimizer = build_zero_optimizer(
        _user_param_groups(prepared.module, model_parameters, client_optimizer),
        checked,
        zero=zero,
        aio=aio,
        reduction=reduction,
        gradient_clipping=root.gradient_clipping,
        comm_dtype=comm_dtype,
        precision=precision,
        topology=topology,
        record=prepared.record,
        disable_allgather=bool(root.disable_allgather),
        param_names={id(p): name for name, p in prepared.module.named_parameters()},
        module=prepared.module,
    )
    zero_optimizer.broadcast_parameters()
    return prepared.module, zero_optimizer


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
        raise ValueError("shardwise.initialize needs model=...")
    if mesh_param is not None:
        raise ValueError("mesh_param (sequence/data-parallel meshes) is not supported in this release")
    source = _config_source(args, config, config_params)
    topology = _start_distributed(distributed_port, dist_init_required, mpu, source, model)
    topology, model_parameters = _apply_autoep(source, model, model_parameters, optimizer, mpu, topology)
    cfg = load_checked_config(
        source,
        context=ResolutionContext(
            # the batch rule divides by sequence_parallel_size itself: give it the dp x sp ranks
            world_size=topology.size_of("sdp") if topology.groups else topology.dp_size,
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
    if root.compression_training is not None:
        from shardwise.compression.zero_rules import prepare_for_engine

        prepare_for_engine(model, cfg, optimizer, model_parameters)
    model, zero_optimizer = _place_and_build_zero(
        root, precision, topology, device, model, model_parameters, optimizer
    )
    _synchronize_buffers(model, topology)
    scheduler = _build_scheduler(root.scheduler, lr_scheduler, zero_optimizer)
    engine = _build_engine(cfg, model, topology, precision, zero_optimizer, scheduler, device, collate_fn)
    loader = None
    if training_data is not None:
        loader = engine.deepspeed_io(training_data)
        engine.training_dataloader = loader
    _log_ready(cfg, precision, topology, activation_checkpointing)
    return engine, zero_optimizer, loader, scheduler


def _start_distributed(
    distributed_port: int, dist_init_required: bool | None, mpu: object, source: object, model: Any = None
) -> Topology:
    """Join (or start) the process group and read the process layout, registered for
    :mod:`shardwise.comm.groups`' accessors.

    Without an mpu the layout is the one :mod:`shardwise.comm.mesh` owns when a feature
    declared a dimension (a ``PipelineModule``, ``tp_model_init``, the model's MoE layers: their
    ``ep_size`` is declared here, :func:`shardwise.moe.declare.declare_expert_parallelism`) or the config
    does (``sequence_parallel_size``, ``tensor_parallel.autotp_size``); otherwise (and with an
    mpu) it is read as before.
    """
    comm.init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required)
    sp, tp = _declared_in_config(source)
    if model is not None and expert_parallel_degree(model) > 1 and mpu is not None:
        raise ValueError(
            "MoE layers with ep_size > 1 and an mpu: shardwise builds expert groups from its own process "
            "layout (shardwise.comm.mesh), not from an mpu's groups; fix: drop mpu= (declare tensor "
            "parallelism with the config's tensor_parallel.autotp_size) or use ep_size=1"
        )
    if model is not None:
        declare_expert_parallelism(model)  # collective: the MoE layers' ep_size into the layout
    if mpu is None and (mesh.current_layout() is not None or sp is not None or tp is not None):
        return mesh.ensure_layout(sp=sp, tp=tp, source="the config (sequence_parallel_size / tensor_parallel)")
    topology = build_topology(mpu)
    set_topology(topology)  # utils.groups-style accessors (shardwise.comm.groups) read this layout
    return topology


def _apply_autoep(
    source: object, model: Any, model_parameters: Any, optimizer: Any, mpu: object, topology: Topology
) -> tuple[Topology, Any]:
    """The config's ``expert_parallel`` (AutoEP): declare ``ep`` and convert the model's MoE blocks
    (:mod:`shardwise.moe.autoep`); parameter lists and a client optimizer built before are re-pointed
    at the kept experts. Nothing without the section (or with ``autoep_size`` 1)."""
    raw = read_config_source(source)[0] if isinstance(source, (str, os.PathLike, Mapping)) else {}
    settings = autoep_settings(raw.get("expert_parallel"))
    if settings is None or settings.autoep_size == 1:
        return topology, model_parameters
    if mpu is not None:
        raise ValueError(
            "expert_parallel (AutoEP) with an mpu: shardwise builds expert groups in its own process layout; "
            "fix: drop mpu="
        )
    topology = mesh.ensure_layout(ep=settings.autoep_size, source="expert_parallel.autoep_size")
    replaced = convert_model(model, settings, topology.group_of("ep"), topology.rank_in("ep"))
    if optimizer is not None and hasattr(optimizer, "param_groups"):
        for group in optimizer.param_groups:
            group["params"] = [replaced.get(id(p), p) for p in group["params"]]
    return topology, repoint(model_parameters, replaced)


def _declared_in_config(source: object) -> tuple[int | None, int | None]:
    """The config's ``sequence_parallel_size`` and ``tensor_parallel.autotp_size`` when they ask
    for more than one rank (validated later with the rest of the config)."""
    if not isinstance(source, (str, os.PathLike, Mapping)):
        return None, None
    raw, _ = read_config_source(source)
    tp_section = raw.get("tensor_parallel")
    sp = raw.get("sequence_parallel_size")
    tp = tp_section.get("autotp_size") if isinstance(tp_section, dict) else None
    return (
        sp if isinstance(sp, int) and not isinstance(sp, bool) and sp > 1 else None,
        tp if isinstance(tp, int) and not isinstance(tp, bool) and tp > 1 else None,
    )


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
    """Every data-parallel rank takes the first rank's buffers; expanded views that differ are an error.
    Buffers of expert-parallel experts (each rank holds other experts) come from the first rank of
    their expert-data-parallel group instead."""
    source = comm.group_source_rank(topology.dp_group)
    experts = global_expert_names(model)
    buffers = [(name, b) for name, b in model.named_buffers() if name not in experts]
    unequal = [name for name, b in buffers if not comm.broadcast_into(b, src=source, group=topology.dp_group)]
    if experts and topology.size_of("edp") > 1:
        edp = topology.group_of("edp")
        for name, b in model.named_buffers():
            if name in experts:
                comm.broadcast_into(b, src=comm.group_source_rank(edp), group=edp)
    # Only expanded buffers can fail, and the model's structure is the same on every rank: the
    # agreement (every rank stops, not just the one that differs) costs a collective only then.
    shared = any(not b.is_contiguous() and 0 in b.stride() for _, b in buffers)
    if shared and comm.all_reduce_max_flag(bool(unequal), group=topology.dp_group):
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
    return ShardwiseEngine(
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
    )


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
