"""Choose and build the ZeRO strategy for a config, once.

Stages 0-2 are our flat-buffer ``ZeroOptimizer``; stage 3 (parameter sharding on FSDP2)
is a separate issue and is refused here with a clear error rather than half-run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from shardwise.comm.topology import Topology
from shardwise.config.errors import ConfigError
from shardwise.config.model import ShardwiseConfig
from shardwise.precision.policy import DTYPES, PrecisionPolicy
from shardwise.zero.sharded_optimizer import OptimizerFactory, ZeroOptimizer, ZeroPolicy


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


def build_zero_optimizer(
    cfg: ShardwiseConfig,
    precision: PrecisionPolicy,
    topology: Topology,
    param_groups: Sequence[dict[str, Any]],
    optimizer_factory: OptimizerFactory,
    device: torch.device,
) -> ZeroOptimizer:
    """The ZeRO optimizer for stages 0-2."""
    zero = cfg.zero_optimization
    stage = cfg.zero_stage
    if stage == 3:
        raise ConfigError(
            "zero_optimization.stage",
            "stage 3 (parameter partitioning) is not available in this release",
            "use stage 2 (gradients and optimizer state sharded) for now",
            value=3,
        )
    if device.type != "cpu" and (
        zero.offload_optimizer_device != "none" or zero.offload_param_device != "none"
    ):
        raise ConfigError(
            "zero_optimization.offload_optimizer.device",
            "offload to CPU/NVMe from an accelerator is not available in this release",
            "remove the offload blocks",
            value=zero.offload_optimizer_device,
        )
    pre, post = reduction_factors(cfg, topology.dp_size)
    comm_dtype = DTYPES[cfg.communication_data_type] if cfg.communication_data_type else None
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
