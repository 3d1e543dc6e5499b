"""The model placed and the ZeRO optimizer built, as ``initialize`` asks; and the optimizer it returns.

:func:`place_and_build_zero` places (stage 3: shards) the model and builds the ZeRO optimizer over
the inner optimizer: the client's object (re-pointed in place), its callable, or the config's
``optimizer`` section; DeepSpeed's Muon split and its checks (``zero_allow_untested_optimizer``,
``zero_force_ds_cpu_optimizer``) included. :func:`returned_optimizer` is the object ``initialize``
hands back, DeepSpeed's choice.

Example:
    >>> returned_optimizer(None, 0, None) is None
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from shardwise.comm.topology import Topology
from shardwise.config.errors import ZeRORuntimeException
from shardwise.config.model import ShardwiseConfig
from shardwise.config.sections.training import OptimizerConfig
from shardwise.optim.client import adopt_client_optimizer, client_param_groups
from shardwise.precision.policy import PrecisionPolicy
from shardwise.preflight import zero_optimizer_error
from shardwise.zero.strategy import ZeroStrategy


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


def place_and_build_zero(
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
