"""Choose and build the ZeRO strategy for a config, once.

Two steps, both called from ``initialize``:

- :func:`prepare_module` places the model: device and dtype at stages 0-2; at stage 3 it
  shards the model in place with FSDP2 (:func:`shardwise.zero.fsdp_wrap.shard_model`).
- :func:`build_zero_optimizer` returns the :class:`~shardwise.zero.strategy.ZeroStrategy`
  the engine talks to: the flat-buffer ``ZeroOptimizer`` for stages 0-2 (its inner
  optimizer wrapped by an offload store when ``offload_optimizer`` is set),
  ``Stage3Optimizer`` for stage 3.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from shardwise.comm.topology import Topology
from shardwise.config.errors import ConfigError
from shardwise.config.model import ShardwiseConfig
from shardwise.precision.policy import DTYPES, PrecisionPolicy
from shardwise.zero.init_context import stash_of
from shardwise.zero.offload import (
    OffloadedOptimizer,
    OffloadSpec,
    OffloadStore,
    optimizer_offload_spec,
    param_offload_spec,
)
from shardwise.zero.sharded_optimizer import OptimizerFactory, ZeroOptimizer, ZeroPolicy
from shardwise.zero.strategy import ZeroStrategy


def reduction_factors(cfg: ShardwiseConfig, world_size: int) -> tuple[float, float]:
    """``(pre_multiplier, post_divisor)`` implementing gradient averaging (spec 7.2).

    Gradients are summed by the collective; the mean is ``sum / W``. Prescaling multiplies
    by ``1/W`` before; a predivide factor ``f`` multiplies by ``1/f`` before and leaves
    ``W/f`` for after. The post divisor is folded into the unscale/clip multiply of the step,
    so averaging costs no extra pass over the gradients.

    Example:
        >>> from shardwise.config import load_config
        >>> reduction_factors(load_config({"train_batch_size": 8}).config, 4)
        (1.0, 4.0)
    """
    if cfg.gradient_allreduce_op == "sum":
        return 1.0, 1.0
    if cfg.prescale_gradients:
        return 1.0 / world_size, 1.0
    f = cfg.gradient_predivide_factor
    return (1.0 / f if f != 1.0 else 1.0), world_size / f


def _check_offload(cfg: ShardwiseConfig) -> None:
    zero = cfg.zero_optimization
    stage = cfg.zero_stage
    if zero.offload_optimizer_device != "none" and stage == 0:
        raise ConfigError(
            "zero_optimization.offload_optimizer.device",
            "optimizer offload needs ZeRO stage 1, 2 or 3 (stage 0 keeps no optimizer partition to offload)",
            "set zero_optimization.stage to 1 or more, or remove the offload_optimizer block",
            value=zero.offload_optimizer_device,
        )


def _has_placeholders(model: nn.Module) -> bool:
    return any(stash_of(p) is not None for p in model.parameters())


def prepare_module(
    cfg: ShardwiseConfig,
    precision: PrecisionPolicy,
    topology: Topology,
    model: nn.Module,
    device: torch.device,
) -> nn.Module:
    """Put the model where the ZeRO stage wants it; at stage 3, shard it with FSDP2.

    Stages 0-2: ``model.to(device)`` and, for 16-bit training, ``model.to(dtype)``.
    Stage 3: :func:`shardwise.zero.fsdp_wrap.shard_model` (in place; the same object is
    returned). Models built under ``zero.Init`` need stage 3.

    Example:
        >>> # model = prepare_module(cfg, precision, topology, model, torch.device("cpu"))
    """
    _check_offload(cfg)
    if cfg.zero_stage != 3:
        if _has_placeholders(model):
            raise ConfigError(
                "zero_optimization.stage",
                f"the model was built under shardwise.zero.Init, which partitions parameters: it needs stage 3, "
                f"not {cfg.zero_stage}",
                "set zero_optimization.stage to 3, or build the model without zero.Init",
                value=cfg.zero_stage,
            )
        model.to(device=device)
        if precision.param_dtype != torch.float32:
            model.to(dtype=precision.param_dtype)
        return model
    if topology.mp_size > 1:
        raise ConfigError(
            "zero_optimization.stage",
            "stage 3 (FSDP2) with tensor/model parallelism from an mpu is not supported",
            "use stage 1 or 2 with model parallelism",
            value=3,
        )
    from shardwise.zero.fsdp_wrap import ShardPolicy, shard_model
    from shardwise.zero.stage3_settings import settings_from_zero

    comm = DTYPES[cfg.communication_data_type] if cfg.communication_data_type else None
    policy = ShardPolicy(
        settings=settings_from_zero(cfg.zero_optimization),
        compute_dtype=precision.param_dtype,
        reduce_dtype=comm or precision.grad_accum_dtype,
        process_group=topology.dp_group,
        device=device,
        param_offload=param_offload_spec(cfg.zero_optimization, cfg.aio),
        rank=topology.dp_rank,
        world_size=topology.dp_size,
    )
    shard_model(model, policy)
    return model


def _offloaded_factory(factory: OptimizerFactory, spec: OffloadSpec, rank: int) -> OptimizerFactory:
    """Build the inner optimizer over an offload store's host tensors, behind a proxy."""

    def build(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        store = OffloadStore(groups, spec, rank=rank)
        return OffloadedOptimizer(factory(store.host_groups), store)

    return build


def build_zero_optimizer(
    cfg: ShardwiseConfig,
    precision: PrecisionPolicy,
    topology: Topology,
    param_groups: Sequence[dict[str, Any]],
    optimizer_factory: OptimizerFactory,
    device: torch.device,
) -> ZeroStrategy:
    """The ZeRO strategy for the config's stage: ``ZeroOptimizer`` (0-2) or ``Stage3Optimizer``.

    Stage 3 needs the model to have gone through :func:`prepare_module` first.
    """
    zero = cfg.zero_optimization
    stage = cfg.zero_stage
    _check_offload(cfg)
    pre, post = reduction_factors(cfg, topology.dp_size)
    comm_dtype = DTYPES[cfg.communication_data_type] if cfg.communication_data_type else None
    if stage == 3:
        return _build_stage3(cfg, precision, topology, param_groups, optimizer_factory, pre, post, comm_dtype)
    spec = optimizer_offload_spec(zero, cfg.aio)
    if spec is not None:
        optimizer_factory = _offloaded_factory(optimizer_factory, spec, topology.dp_rank)
    policy = ZeroPolicy(
        stage=stage,
        rank=topology.dp_rank,
        world_size=topology.dp_size,
        bucket_numel=int(zero.reduce_bucket_size),
        overlap_comm=zero.overlap_comm_effective,
        grad_dtype=precision.grad_accum_dtype,
        comm_dtype=comm_dtype,
        pre_multiplier=pre,
        post_divisor=post,
        check_overflow=precision.check_overflow,
        gradient_clipping=cfg.gradient_clipping,
        process_group=topology.dp_group,
        mp_group=topology.mp_group if topology.mp_size > 1 else None,
        mp_rank=topology.mp_rank,
    )
    return ZeroOptimizer(param_groups, optimizer_factory, policy)


def _build_stage3(
    cfg: ShardwiseConfig,
    precision: PrecisionPolicy,
    topology: Topology,
    param_groups: Sequence[dict[str, Any]],
    optimizer_factory: OptimizerFactory,
    pre: float,
    post: float,
    comm_dtype: torch.dtype | None,
) -> ZeroStrategy:
    from shardwise.zero.stage3 import Stage3Optimizer, Stage3Policy

    zero = cfg.zero_optimization
    record = None
    for group in param_groups:
        for p in group["params"]:
            record = getattr(p, "_shardwise_record", None)
            if record is not None:
                break
        if record is not None:
            break
    if record is None:
        raise ValueError(
            "stage 3: the parameters are not sharded; shardwise.initialize shards the model before building "
            "the optimizer (zero.factory.prepare_module) - call that first when building parts by hand"
        )
    policy = Stage3Policy(
        rank=topology.dp_rank,
        world_size=topology.dp_size,
        pre_multiplier=pre,
        post_divisor=post,
        check_overflow=precision.check_overflow,
        gradient_clipping=cfg.gradient_clipping,
        process_group=topology.dp_group,
        comm_dtype=comm_dtype,
        reduce_bucket_numel=int(zero.reduce_bucket_size),
        optimizer_offload=optimizer_offload_spec(
            zero, cfg.aio, masters_on_host=zero.offload_param_device != "none"
        ),
    )
    return Stage3Optimizer(record, param_groups, optimizer_factory, policy)
