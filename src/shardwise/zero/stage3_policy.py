"""Stage 3's policy and its FSDP2 collective hooks.

:class:`Stage3Policy` is what the stage-3 optimizer needs from the config, decided once by
:func:`shardwise.zero.factory.build_zero_optimizer`; :func:`choose_unit_hooks` is the one place
that picks the collectives FSDP2 runs for every unit (:class:`UnitHooks`): ZeRO++ qgZ/qwZ, the
shared-memory transport (:mod:`shardwise.comm.fsdp_shared_hooks`), the deferred reduce-scatter
(:class:`~shardwise.zero.deferred_reduce_scatter.DeferredReduceScatter`), or FSDP2's own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from shardwise.comm.fsdp_shared_hooks import open_unit_comms
from shardwise.comm.group_type import Group
from shardwise.comm.quantized_collectives import QuantizedReduceScatter, all_gather_hook
from shardwise.zero.deferred_reduce_scatter import DeferredReduceScatter
from shardwise.zero.offload_spec import OffloadSpec
from shardwise.zero.sharded_model import ShardedModel

__all__ = ["Stage3Policy", "UnitHooks", "choose_unit_hooks"]


@dataclass(frozen=True)
class Stage3Policy:
    """What the stage-3 optimizer needs from the config, decided once."""

    rank: int
    world_size: int
    pre_multiplier: float
    post_divisor: float
    check_overflow: bool
    gradient_clipping: float
    process_group: Group = None
    comm_dtype: torch.dtype | None = None
    reduce_bucket_numel: int = 500_000_000
    optimizer_offload: OffloadSpec | None = None
    quantized_weights: bool = False
    quantized_gradients: bool = False
    fail_on_unused: bool = False  # ignore_unused_parameters: false
    param_names: Mapping[int, str] | None = None
    sub_group_size: int = 1_000_000_000  # elements per optimizer step call (no offload store)
    mp_group: Group = None  # tensor parallel (with mp_size > 1, None is the world)
    mp_size: int = 1
    tp_param_names: frozenset[str] = frozenset()  # parameters split over the tensor-parallel ranks


@dataclass(frozen=True)
class UnitHooks:
    """The custom collectives FSDP2 runs for every unit (None: FSDP2's own)."""

    reduce_scatter: object = None
    all_gather: object = None


def choose_unit_hooks(record: ShardedModel, policy: Stage3Policy) -> UnitHooks:
    """Stage 3's FSDP2 collective hooks, chosen in one place.

    Reduce-scatter: ZeRO++ qgZ when ``zero_quantized_gradients``; else, for fp32 reduction on CPU,
    the shared-memory transport when all ranks share a host (:func:`open_unit_comms`), else the
    deferred asynchronous one (not with NVMe parameters: it holds every unit's full gradients
    until backward ends); else FSDP2's. All-gather: qwZ when ``zero_quantized_weights``, else the
    shared-memory one when it is open, else the logged plain one (or FSDP2's).
    """
    cpu_fp32 = record.policy.device.type == "cpu" and record.policy.reduce_dtype == torch.float32
    shared = None  # ranks on one host: FSDP2's collectives through shared memory
    if cpu_fp32 and not policy.quantized_gradients and policy.world_size > 1:
        shared = open_unit_comms(record.fsdp_modules(), policy.rank)
    reduce_scatter: object = None
    if policy.quantized_gradients:
        reduce_scatter = QuantizedReduceScatter()
    elif shared is not None:
        reduce_scatter = shared[1]
    elif cpu_fp32 and record.swapper is None:
        reduce_scatter = DeferredReduceScatter()
    gather: object = all_gather_hook(policy.quantized_weights)  # qwZ, or a logged plain one, or FSDP2's own
    if shared is not None and not policy.quantized_weights:
        gather = shared[0]
    return UnitHooks(reduce_scatter, gather)
