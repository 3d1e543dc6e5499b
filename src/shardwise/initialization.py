"""``initialize``: read the config once and build everything, in order.

(The module is not called ``initialize.py`` because importing a submodule of that name
would shadow the ``shardwise.initialize`` function on the package.)

topology -> config (with the objects handed in resolving "auto") -> comms logger ->
activation checkpointing (``shardwise.checkpointing`` configured from its section) -> precision -> module placement and dtype -> ZeRO strategy -> scheduler -> telemetry
(monitors, timers) -> step hooks (the flops profiler...) -> checkpointer -> engine -> compile (only the
legacy ``compile.disable: false``) -> data loader.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, TypeGuard

import torch
from torch import nn

from shardwise import comm
from shardwise.autoep.convert import autoep_config, convert_model, repoint
from shardwise.checkpoint.engine_io import build_checkpointer
from shardwise.checkpoint.snapshot_io import build_snapshots
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
from shardwise.compilation.compiler import ModelCompiler
from shardwise.config import ConfigError, ResolutionContext, ResolvedConfig
from shardwise.config.errors import AssertedValueError, ZeRORuntimeException
from shardwise.config.loading import read_config_source
from shardwise.config.model import ShardwiseConfig
from shardwise.config.sections.training import OptimizerConfig, SchedulerConfig
from shardwise.engine import ShardwiseEngine
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


def _is_muon(section: OptimizerConfig | None, client_optimizer: object) -> bool:
    """The config names DeepSpeed's Muon (and no client optimizer replaces it)."""
    return client_optimizer is None and section is not None and section.type.lower() == "muon"


def _check_client_offload_optimizer(root: ShardwiseConfig, optimizer: object) -> None:
    """``zero_force_ds_cpu_optimizer`` (default true), as DeepSpeed: with optimizer offload a client
    optimizer must be ``DeepSpeedCPUAdam`` / ``DeepSpeedCPULion`` unless the key is false.

    In DeepSpeed those classes are its compiled CPU kernels; in shardwise they are torch's Adam and
    shardwise's Lion, so any client optimizer would run, but a script DeepSpeed refuses is refused
    here too (configs that mean it set the key false, as many do).
    """
    from shardwise.optim.fused_adam import DeepSpeedCPUAdam
    from shardwise.optim.lion import DeepSpeedCPULion

    inner = getattr(optimizer, "inner", optimizer)  # the offload proxy holds the client's object
    if root.zero_force_ds_cpu_optimizer and not isinstance(inner, DeepSpeedCPUAdam | DeepSpeedCPULion):
        raise ZeRORuntimeException(
            f"'zero_force_ds_cpu_optimizer' = true: ZeRO optimizer offload with a client optimizer "
            f"({type(inner).__name__}) is refused, as DeepSpeed refuses it (its offloaded step is meant for its "
            "CPU optimizers); fix: pass deepspeed.ops.adam.DeepSpeedCPUAdam (or DeepSpeedCPULion), put the "
            'optimizer in the config, or set "zero_force_ds_cpu_optimizer": false to run this one'
        )


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
    from shardwise.tensor_parallel.engine_setup import split_parameter_names
    from shardwise.zero.factory import (
        build_zero_optimizer,
        communication_dtype,
        prepare_module,
        reduction_factors,
    )

    zero, aio = root.zero_optimization, root.aio
    # under sequence parallelism DeepSpeed reduces gradients in seq_parallel_communication_data_type (default fp32)
    sequence_parallel = topology.sp_size > 1
    comm_dtype = communication_dtype(
        root.seq_parallel_communication_data_type if sequence_parallel else root.communication_data_type
    )
    muon = _is_muon(root.optimizer, client_optimizer)
    if muon:  # before sharding: stage 3 keeps the tagged matrices whole
        from shardwise.optim.muon_groups import tag_muon_parameters

        tag_muon_parameters(model)
    tp_param_names = split_parameter_names(model)  # before FSDP2 replaces the parameters (stage 3)
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
        if offload and client_optimizer is not None:
            _check_client_offload_optimizer(root, inner)
        return inner

    reduction = reduction_factors(  # ZeRO averages over data x sequence parallel (sdp): see docs/sequence-parallelism.md
        topology.shard_size,
        allreduce_op=root.gradient_allreduce_op,
        prescale=root.prescale_gradients,
        predivide_factor=root.gradient_predivide_factor,
    )
    groups = _user_param_groups(prepared.module, model_parameters, client_optimizer)
    if muon:  # DeepSpeed's split: the Muon half and the AdamW half of every group
        from shardwise.optim.muon_groups import muon_param_groups

        assert root.optimizer is not None
        groups = muon_param_groups(groups, dict(root.optimizer.params))
    zero_optimizer = build_zero_optimizer(
        groups,
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
        tp_param_names=tp_param_names,
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
        raise _missing_model(args)
    source = _merge_tp_model_init(_config_source(args, config, config_params), mpu)
    topology = _start_distributed(distributed_port, dist_init_required, mpu, source, mesh_param, model)
    topology, model_parameters = _apply_autoep(source, model, model_parameters, optimizer, mpu, topology)
    cfg = load_checked_config(
        source,
        context=ResolutionContext(
            # the batch rule divides by the config's sequence_parallel_size itself: then give it the dp x sp
            # ranks; an sp declared elsewhere (an mpu, register_with_transformers) leaves the dp ranks
            world_size=topology.dp_size * (topology.sp_size if _declared_in_config(source)[0] else 1),
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
    model_parameters = _split_tensor_parallel(root, topology, model, model_parameters, optimizer)
    if root.compression_training is not None:
        from shardwise.compression.zero_rules import prepare_for_engine

        prepare_for_engine(model, cfg, optimizer, model_parameters)
    zero_topology = topology
    if _is_pipeline(model):
        from shardwise.pipe import setup as pipe_setup

        model_parameters = pipe_setup.prepare(model, root, model_parameters)  # may re-cut it into chunks
        zero_topology = pipe_setup.norm_topology(topology, model)  # gradient norm over every stage
    model, zero_optimizer = _place_and_build_zero(
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


def returned_optimizer(strategy: ZeroStrategy | None, stage: int, precision: PrecisionPolicy) -> Any:
    """The optimizer ``initialize`` returns: DeepSpeed's choice of object.

    DeepSpeed returns its ``engine.optimizer``, which is the bare torch optimizer (the client's own
    object, the one its callable built, or the config's ``FusedAdam``) at ZeRO stage 0 when the
    model and its gradients are fp32, and a wrapper (ZeRO or fp16/bf16 optimizer) otherwise.
    Scripts and DeepSpeed's tests rely on that: ``optimizer is client_optimizer``,
    ``isinstance(optimizer, FusedAdam)``, ``optimizer.param_groups``/``state`` of a torch optimizer.

    shardwise's ``engine.optimizer`` is always its :class:`~shardwise.zero.strategy.ZeroStrategy`
    (the engine drives every stage through it), so here the strategy's inner torch optimizer is
    returned in exactly DeepSpeed's case, and the strategy everywhere else. What that object does
    is safe to use as DeepSpeed's is: it steps the strategy's fp32 masters (at stage 0 the whole
    parameters) and is stepped by ``engine.step()``, which also publishes the masters to the
    model; a script's ``optimizer.zero_grad()`` only drops references the strategy binds again
    before each step; accelerate's ``DeepSpeedOptimizerWrapper`` finds no ``overflow`` on it, as on
    DeepSpeed's (``engine.optimizer.overflow`` and ``engine.skipped_steps`` still say when a
    non-finite step was skipped).

    Example:
        >>> returned_optimizer(None, 0, None) is None
        True
    """
    if strategy is None or stage != 0:
        return strategy
    inner = getattr(strategy, "optimizer", None)
    fp32 = precision.param_dtype == torch.float32 and precision.grad_accum_dtype == torch.float32
    return inner if fp32 and isinstance(inner, torch.optim.Optimizer) else strategy


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


def _merge_tp_model_init(source: Any, mpu: object) -> Any:
    """The config with ``tp_model_init``'s recorded degree and dtype merged into ``tensor_parallel``."""
    from shardwise.tensor_parallel.model_init import merge_into_config, recorded

    if recorded() is None:
        return source
    from shardwise.config.loading import read_config_source

    raw, _ = read_config_source(source)
    return merge_into_config(raw, mpu)


def _split_tensor_parallel(
    root: ShardwiseConfig, topology: Topology, model: nn.Module, model_parameters: Any, optimizer: object
) -> Any:
    """Split the model over the tensor-parallel dimension (``tensor_parallel.autotp_size`` > 1);
    returns ``model_parameters`` (and re-points a client optimizer) at the local slices."""
    from shardwise.tensor_parallel.engine_setup import remap_optimizer, remap_parameters, split_for_engine
    from shardwise.tensor_parallel.model_init import set_autotp_mode

    section = root.tensor_parallel
    if section.autotp_size > 0:
        set_autotp_mode(training=True)  # as DeepSpeed's initialize does for an AutoTP config
    if section.autotp_size > 1:
        from shardwise.zero.init_context import stash_of

        if any(stash_of(p) is not None for p in model.parameters()):
            raise ConfigError(
                "tensor_parallel.autotp_size",
                "the model was built under zero.Init (its parameters are placeholders), so it cannot be split",
                "build the model without zero.Init when training it with tensor parallelism (stage 3 still shards "
                "the slices)",
                value=section.autotp_size,
            )
    report = split_for_engine(model, section, topology, zero_stage=root.zero_stage)
    if report is None:
        return model_parameters
    remap_optimizer(optimizer, report)
    logger.info("tensor parallel: %d layers split over %d ranks (%s)", len(report.kinds), topology.mp_size,
                report.source)
    return remap_parameters(model_parameters, report)


def _start_distributed(
    distributed_port: int,
    dist_init_required: bool | None,
    mpu: object,
    source: object,
    mesh_param: Any = None,
    model: Any = None,
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
    if getattr(mpu, "reads_process_layout", False):
        mpu = (
            None  # an mpu over the mesh itself (shardwise.sequence.parallel_state): the layout is the mesh's
        )
    sp, tp = _declared_in_config(source)
    if mesh_param is not None:
        sp = _sequence_degree_of_mesh_param(mesh_param, comm.get_world_size())
    if model is not None and expert_parallel_degree(model) > 1 and mpu is not None:
        raise ValueError(
            "MoE layers with ep_size > 1 and an mpu: shardwise builds expert groups from its own process "
            "layout (shardwise.comm.mesh), not from an mpu's groups; fix: drop mpu= (declare tensor "
            "parallelism with the config's tensor_parallel.autotp_size) or use ep_size=1"
        )
    if model is not None:
        declare_expert_parallelism(model)  # collective: the MoE layers' ep_size into the layout
    if mpu is None and (mesh.current_layout() is not None or sp is not None or tp is not None):
        return mesh.ensure_layout(
            sp=sp, tp=tp, source="the config (sequence_parallel_size / tensor_parallel)"
        )
    topology = build_topology(mpu)
    set_topology(topology)  # utils.groups-style accessors (shardwise.comm.groups) read this layout
    return topology


def _sequence_degree_of_mesh_param(mesh_param: Any, world: int) -> int | None:
    """DeepSpeed's ``initialize(mesh_param=(data_parallel, sequence_parallel))``: the sp degree it declares."""
    valid = isinstance(mesh_param, (tuple, list)) and len(mesh_param) == 2
    if not valid or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in mesh_param):
        raise ValueError(
            f"mesh_param={mesh_param!r}: DeepSpeed's mesh_param is (data_parallel_size, sequence_parallel_size), "
            "two ints >= 1; e.g. mesh_param=(2, 2) on 4 ranks"
        )
    dp, sp = mesh_param
    if dp * sp != world:
        raise ValueError(
            f"mesh_param={tuple(mesh_param)}: data_parallel_size {dp} x sequence_parallel_size {sp} must equal "
            f"the world size {world}; launch {dp * sp} ranks or change mesh_param"
        )
    return sp if sp > 1 else None


def _apply_autoep(
    source: object, model: Any, model_parameters: Any, optimizer: Any, mpu: object, topology: Topology
) -> tuple[Topology, Any]:
    """The config's ``expert_parallel`` (AutoEP): declare ``ep`` and convert the model's MoE blocks
    (:mod:`shardwise.autoep.convert`); parameter lists and a client optimizer built before are re-pointed
    at the kept experts. Nothing without the section (or with ``autoep_size`` 1)."""
    raw = read_config_source(source)[0] if isinstance(source, (str, os.PathLike, Mapping)) else {}
    config = autoep_config(raw.get("expert_parallel"), topology)
    if config is None:
        return topology, model_parameters
    if mpu is not None:
        raise ValueError(
            "expert_parallel (AutoEP) with an mpu: shardwise builds expert groups in its own process layout; "
            "fix: drop mpu="
        )
    replaced = convert_model(model, config, topology)
    if config.autoep_size > 1:
        topology = mesh.current_layout() or topology
    if optimizer is not None and hasattr(optimizer, "param_groups"):
        for group in optimizer.param_groups:
            group["params"] = repoint(list(group["params"]), replaced)
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
