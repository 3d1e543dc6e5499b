"""Choose and build the ZeRO strategy for a config, once.

Two steps, both called from ``initialize``; each receives the config sections it reads
(``zero_optimization``, ``aio``) and plain values, never the whole config:

- :func:`prepare_module` places the model: device and dtype at stages 0-2; at stage 3 it
  shards the model in place with FSDP2 (:func:`shardwise.zero.fsdp_wrap.shard_model`) and
  returns the :class:`~shardwise.zero.sharded_model.ShardedModel` record with it
  (:class:`PreparedModel`);
- :func:`build_zero_optimizer` returns the :class:`~shardwise.zero.strategy.ZeroStrategy` the engine talks to: the flat-buffer
  ``ZeroOptimizer`` for stages 0-2 (its inner optimizer wrapped by an offload store when
  ``offload_optimizer`` is set), ``Stage3Optimizer`` for stage 3, built on the record
  ``prepare_module`` returned.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from shardwise.comm.topology import Topology
from shardwise.config.errors import ConfigError
from shardwise.config.sections.zero import AioConfig, ZeroConfig
from shardwise.precision.buffer_dtypes import cast_for_training
from shardwise.precision.policy import DTYPES, PrecisionPolicy
from shardwise.zero.expert_units import ExpertSharding, refuse_zero3_expert_parallel
from shardwise.zero.init_context import stash_of
from shardwise.zero.offload import (
    OffloadedOptimizer,
    OffloadSpec,
    OffloadStore,
    optimizer_offload_spec,
    param_offload_spec,
)
from shardwise.zero.param_publish import PublishPolicy
from shardwise.zero.reduction_domain import ExpertLayout, expert_group_name
from shardwise.zero.sharded_model import ShardedModel
from shardwise.zero.sharded_optimizer import OptimizerFactory, ZeroOptimizer, ZeroPolicy
from shardwise.zero.strategy import ZeroStrategy


@dataclass(frozen=True)
class PreparedModel:
    """What :func:`prepare_module` did: the module, and at stage 3 its sharding record."""

    module: nn.Module
    record: ShardedModel | None = None


if TYPE_CHECKING:
    from shardwise.zero.stage3_policy import Stage3Policy


def communication_dtype(name: str | None) -> torch.dtype | None:
    """``communication_data_type`` as a torch dtype (None: reduce in the gradients' dtype).

    Example:
        >>> communication_dtype("bf16"), communication_dtype(None)
        (torch.bfloat16, None)
    """
    return DTYPES[name] if name else None


def reduction_factors(
    world_size: int,
    *,
    allreduce_op: str = "mean",
    prescale: bool = False,
    predivide_factor: float = 1.0,
) -> tuple[float, float]:
    """``(pre_multiplier, post_divisor)`` implementing gradient averaging (spec 7.2).

    Gradients are summed by the collective; the mean is ``sum / W``. Prescaling multiplies
    by ``1/W`` before; a predivide factor ``f`` multiplies by ``1/f`` before and leaves
    ``W/f`` for after. The post divisor is folded into the unscale/clip division of the step,
    so averaging costs no extra pass over the gradients. The keywords are the config's
    ``gradient_allreduce_op``, ``prescale_gradients`` and ``gradient_predivide_factor``.

    Example:
        >>> reduction_factors(4)
        (1.0, 4.0)
        >>> reduction_factors(4, predivide_factor=2.0)
        (0.5, 2.0)
    """
    if allreduce_op == "sum":
        return 1.0, 1.0
    if prescale:
        return 1.0 / world_size, 1.0
    f = predivide_factor
    return (1.0 / f if f != 1.0 else 1.0), world_size / f


def _has_placeholders(model: nn.Module) -> bool:
    return any(stash_of(p) is not None for p in model.parameters())


def prepare_module(
    model: nn.Module,
    *,
    zero: ZeroConfig,
    aio: AioConfig,
    comm_dtype: torch.dtype | None,
    precision: PrecisionPolicy,
    topology: Topology,
    device: torch.device,
) -> PreparedModel:
    """Put the model where the ZeRO stage wants it; at stage 3, shard it with FSDP2.

    Stages 0-2: ``model.to(device)`` and, for 16-bit training, the parameters to that dtype (buffers
    as ``data_types`` says: :mod:`shardwise.precision.buffer_dtypes`).
    Stage 3: :func:`shardwise.zero.fsdp_wrap.shard_model` (in place: the same module object
    comes back, with the record :func:`build_zero_optimizer` needs). Models built under
    ``zero.Init`` need stage 3.

    Args:
        model: the user's module.
        zero: the ``zero_optimization`` section.
        aio: the ``aio`` section (NVMe parameter offload).
        comm_dtype: ``communication_data_type`` (:func:`communication_dtype`).
        precision: the precision policy.
        topology: data/model-parallel groups.
        device: the training device.

    Example:
        >>> # prepared = prepare_module(model, zero=cfg.zero_optimization, aio=cfg.aio, comm_dtype=None,
        >>> #                           precision=precision, topology=topology, device=torch.device("cpu"))
        >>> # prepared.module, prepared.record
    """
    # (optimizer offload at stage 0 was refused once, when the config was loaded: config.checks)
    stage = int(zero.stage)
    if stage != 3:
        if _has_placeholders(model):
            raise ConfigError(
                "zero_optimization.stage",
                f"the model was built under shardwise.zero.Init, which partitions parameters: it needs stage 3, "
                f"not {stage}",
                "set zero_optimization.stage to 3, or build the model without zero.Init",
                value=stage,
            )
        model.to(device=device)
        if precision.param_dtype != torch.float32:
            cast_for_training(model, precision.param_dtype, precision.buffer_dtype, precision.keep_in_fp32_modules)
        return PreparedModel(model)
    # Tensor parallelism (tensor_parallel.autotp_size, or an mpu's model-parallel layers): FSDP2
    # shards each rank's slices over its data-parallel group, a 2-D layout; the gradient norm
    # counts the split parameters on every tensor-parallel rank (Stage3Policy.tp_param_names).
    # Expert parallelism: expert units shard over the expert-data-parallel mesh (zero.expert_units).
    experts = _expert_sharding(model, zero, topology, device)
    from shardwise.zero.fsdp_wrap import ShardPolicy, shard_model
    from shardwise.zero.stage3_settings import settings_from_zero

    policy = ShardPolicy(
        settings=settings_from_zero(zero),
        compute_dtype=precision.param_dtype,
        reduce_dtype=comm_dtype or precision.grad_accum_dtype,
        process_group=topology.shard_group,
        device=device,
        mesh=topology.data_parallel_mesh(device.type),
        param_offload=param_offload_spec(zero, aio),
        rank=topology.shard_rank,
        world_size=topology.shard_size,
        experts=experts,
        buffer_dtype=precision.buffer_dtype,
        keep_in_fp32_modules=precision.keep_in_fp32_modules,
    )
    return PreparedModel(model, shard_model(model, policy))


def _expert_sharding(
    model: nn.Module, zero: ZeroConfig, topology: Topology, device: torch.device
) -> ExpertSharding | None:
    """Where stage 3 shards a model's expert parameters: None without expert parallelism (``ep`` 1:
    experts are replicated like dense parameters), else the expert-data-parallel mesh, after the
    combinations it does not take are refused by name."""
    ep = topology.size_of("ep")
    if ep == 1 or not any(expert_group_name(p) for p in model.parameters()):
        return None
    refuse_zero3_expert_parallel(
        ep_size=ep,
        sequence_parallel_size=topology.size_of("sp"),
        quantized_gradients=bool(zero.zero_quantized_gradients),
        hpz_partition_size=int(zero.zero_hpz_partition_size),
    )
    from shardwise.comm.mesh import expert_data_parallel_mesh

    return ExpertSharding(
        mesh=expert_data_parallel_mesh(device.type),
        group=topology.group_of("edp"),
        size=topology.size_of("edp"),
        ep_size=ep,
    )


def _offloaded_factory(factory: OptimizerFactory, spec: OffloadSpec, rank: int) -> OptimizerFactory:
    """Build the inner optimizer over an offload store's host tensors, behind a proxy."""

    def build(groups: list[dict[str, object]]) -> torch.optim.Optimizer:
        store = OffloadStore(groups, spec, rank=rank)
        return OffloadedOptimizer(factory(store.host_groups), store)

    return build


def build_zero_optimizer(
    param_groups: Sequence[dict[str, object]],
    optimizer_factory: OptimizerFactory,
    *,
    zero: ZeroConfig,
    aio: AioConfig,
    reduction: tuple[float, float],
    gradient_clipping: float,
    comm_dtype: torch.dtype | None,
    precision: PrecisionPolicy,
    topology: Topology,
    record: ShardedModel | None = None,
    disable_allgather: bool = False,
    param_names: Mapping[int, str] | None = None,
    module: nn.Module | None = None,
    tp_param_names: frozenset[str] = frozenset(),
) -> ZeroStrategy:
    """The ZeRO optimizer for the stage: ``ZeroOptimizer`` (0-2) or ``Stage3Optimizer``.

    Args:
        param_groups: the user's parameter groups.
        optimizer_factory: builds the inner torch optimizer over the tensors ZeRO hands it.
        zero: the ``zero_optimization`` section.
        aio: the ``aio`` section (NVMe optimizer offload).
        reduction: ``(pre_multiplier, post_divisor)`` from :func:`reduction_factors`.
        gradient_clipping: the config's ``gradient_clipping`` (0: off).
        comm_dtype: ``communication_data_type`` (:func:`communication_dtype`).
        precision: the precision policy.
        topology: data/model-parallel groups.
        record: stage 3 only: :attr:`PreparedModel.record` from :func:`prepare_module`.
        disable_allgather: the top-level ``disable_allgather`` (stages 1-2: broadcast the shards).
        param_names: ``id(parameter) -> name`` (names the parameters in the
            ``ignore_unused_parameters: false`` error).
        module: the (placed) model; stages 1-2 with ``overlap_comm`` hook it so the post-step
            all-gather overlaps the next forward (:mod:`shardwise.zero.async_gather`).
        tp_param_names: names of the parameters split over the tensor-parallel ranks (stage 3
            counts them on every rank in the gradient norm; stages 0-2 read the parameters'
            ``tensor_model_parallel`` marker, which FSDP2's DTensor parameters do not carry).
    """
    pre, post = reduction
    if int(zero.stage) == 3:
        if record is None:
            raise ValueError(
                "stage 3: build_zero_optimizer needs the record of the sharded model; shardwise.initialize "
                "passes PreparedModel.record from zero.factory.prepare_module - do the same when building "
                "parts by hand"
            )
        from shardwise.zero.stage3 import Stage3Optimizer

        policy3 = _stage3_policy(
            zero, aio, pre, post, gradient_clipping, comm_dtype, precision, topology, param_names, tp_param_names
        )
        return Stage3Optimizer(record, param_groups, optimizer_factory, policy3)
    spec = optimizer_offload_spec(zero, aio)
    if spec is not None:
        optimizer_factory = _offloaded_factory(optimizer_factory, spec, topology.shard_rank)
    policy = _flat_policy(
        zero, pre, post, gradient_clipping, comm_dtype, precision, topology, disable_allgather, param_names
    )
    return ZeroOptimizer(param_groups, optimizer_factory, policy, module=module)


def _stage3_policy(
    zero: ZeroConfig,
    aio: AioConfig,
    pre: float,
    post: float,
    gradient_clipping: float,
    comm_dtype: torch.dtype | None,
    precision: PrecisionPolicy,
    topology: Topology,
    param_names: Mapping[int, str] | None,
    tp_param_names: frozenset[str] = frozenset(),
) -> Stage3Policy:
    """Stage 3's policy from the config sections and the layout."""
    from shardwise.zero.stage3_policy import Stage3Policy

    return Stage3Policy(
        rank=topology.shard_rank,
        world_size=topology.shard_size,
        pre_multiplier=pre,
        post_divisor=post,
        check_overflow=precision.check_overflow,
        gradient_clipping=gradient_clipping,
        process_group=topology.shard_group,
        comm_dtype=comm_dtype,
        reduce_bucket_numel=int(zero.reduce_bucket_size),
        optimizer_offload=optimizer_offload_spec(
            zero, aio, masters_on_host=zero.offload_param_device != "none"
        ),
        quantized_weights=bool(zero.zero_quantized_weights),
        quantized_gradients=bool(zero.zero_quantized_gradients),
        fail_on_unused=not zero.ignore_unused_parameters,
        param_names=param_names,
        sub_group_size=max(1, int(zero.sub_group_size)),
        mp_group=topology.mp_group,
        mp_size=topology.mp_size,
        tp_param_names=tp_param_names,
    )


def _flat_policy(
    zero: ZeroConfig,
    pre: float,
    post: float,
    gradient_clipping: float,
    comm_dtype: torch.dtype | None,
    precision: PrecisionPolicy,
    topology: Topology,
    disable_allgather: bool,
    param_names: Mapping[int, str] | None,
) -> ZeroPolicy:
    """Stages 0-2's policy from the config sections and the layout."""
    return ZeroPolicy(
        stage=int(zero.stage),
        rank=topology.shard_rank,
        world_size=topology.shard_size,
        bucket_numel=int(zero.reduce_bucket_size),
        overlap_comm=zero.overlap_comm_effective,
        grad_dtype=precision.grad_accum_dtype,
        comm_dtype=comm_dtype,
        pre_multiplier=pre,
        post_divisor=post,
        check_overflow=precision.check_overflow,
        gradient_clipping=gradient_clipping,
        process_group=topology.shard_group,
        mp_group=topology.mp_group if topology.mp_size > 1 else None,
        mp_rank=topology.mp_rank,
        mp_size=topology.mp_size,
        publish=PublishPolicy(
            bucket_numel=int(zero.allgather_bucket_size),
            broadcast=disable_allgather or not zero.allgather_partitions,
            quantized=bool(zero.zero_quantized_weights),
        ),
        all_reduce_gradients=not zero.reduce_scatter,
        fail_on_unused=not zero.ignore_unused_parameters,
        param_names=param_names,
        experts=expert_layout(topology),
    )


def expert_layout(topology: Topology) -> ExpertLayout:
    """The expert groups of this rank from the process layout (``ep`` and ``edp``); without expert
    parallelism the data-parallel group (expert parameters then reduce like dense ones)."""
    ep = topology.size_of("ep")
    if ep == 1:
        return ExpertLayout(None, 1, topology.dp_group, topology.dp_rank, topology.dp_size)
    return ExpertLayout(
        ep_group=topology.group_of("ep"),
        ep_size=ep,
        edp_group=topology.group_of("edp"),
        edp_rank=topology.rank_in("edp"),
        edp_size=topology.size_of("edp"),
        spans_model_parallel=topology.dims.fold_ep and topology.size_of("tp") > 1,
    )
