"""``deepspeed.module_inject.layers`` / ``tp_shard`` / ``auto_tp`` names over :mod:`shardwise.tensor_parallel`.

``LinearLayer`` (column-parallel) and ``LinearAllreduce`` (row-parallel) are shardwise's layers
themselves (they take DeepSpeed's ``(module, mp_group, ...)`` arguments), so ``isinstance`` checks
on a split model hold. ``set_autotp_mode`` / ``is_autotp_training_mode`` keep DeepSpeed's mode flag
(shardwise's tensor parallelism is for training; ``tp_model_init`` turns the flag on).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardwise.comm.groups import current_topology
from shardwise.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, TPGroup
from shardwise.tensor_parallel.model_init import is_autotp_training_mode, set_autotp_mode
from shardwise.tensor_parallel.partitioner import Partitioner
from shardwise.tensor_parallel.shards import shard_sizes
from shardwise.tensor_parallel.specs import PartitionPlan, plan_from_dict

__all__ = [
    "AutoTP",
    "LinearAllreduce",
    "LinearLayer",
    "get_shard_size",
    "get_shard_size_list",
    "is_autotp_training_mode",
    "set_autotp_mode",
]

LinearLayer = ColumnParallelLinear
LinearAllreduce = RowParallelLinear

def get_shard_size_list(total_size: int, mp_size: int, meta: Any = None, name: str | None = None) -> list[int]:
    """Every rank's share of a dimension of ``total_size`` (near-equal, the first ranks take one more)."""
    return list(shard_sizes(total_size, mp_size))


def get_shard_size(total_size: int, mp_size: int, meta: Any = None, name: str | None = None,
                   rank: int | None = None, mp_group: Any = None) -> int:
    """``rank``'s share of a dimension of ``total_size`` (``rank`` in the tensor-parallel group)."""
    if rank is None:
        from shardwise.comm.init import get_rank

        rank = get_rank(mp_group)
    return shard_sizes(total_size, mp_size)[rank]


class AutoTP(Partitioner):
    """``deepspeed.module_inject.auto_tp.AutoTP``: shardwise's :class:`Partitioner` over the registered
    layout's tensor-parallel group, built from DeepSpeed's arguments. ``partition_config`` is a
    :class:`~shardwise.tensor_parallel.specs.PartitionPlan` or the ``partition_config`` dict (None: the
    name rules). DeepSpeed's inference-injection arguments (``all_reduce_linears``, ``state_dict``,
    ``linear_layer_setting``, ``orig_layer_impl``, ``keep_module_on_host``) have no shardwise step: a
    value other than empty is refused by name."""

    def __init__(self, module: Any, all_reduce_linears: Any = None, prefix: str = "", state_dict: Any = None,
                 linear_layer_setting: Any = None, orig_layer_impl: Any = None, partition_config: Any = None,
                 keep_module_on_host: bool = False) -> None:
        for key, value in (("all_reduce_linears", all_reduce_linears), ("state_dict", state_dict),
                           ("linear_layer_setting", linear_layer_setting), ("orig_layer_impl", orig_layer_impl),
                           ("keep_module_on_host", keep_module_on_host)):
            if value:
                raise ValueError(f"AutoTP({key}={value!r}): shardwise's tensor parallelism splits a model for "
                                 "training from its partition_config (or the name rules) and has no inference "
                                 f"injection step that reads {key}; fix: leave it empty")
        plan = plan_from_dict(partition_config) if isinstance(partition_config, Mapping) else partition_config
        if plan is not None and not isinstance(plan, PartitionPlan):
            raise TypeError(f"AutoTP(partition_config={partition_config!r}): expected a PartitionPlan or the "
                            "tensor_parallel.partition_config dict")
        self.module, self.prefix = module, prefix
        topology = current_topology()
        super().__init__(module, TPGroup(topology.mp_group if topology.mp_size > 1 else None, topology.mp_rank,
                                         topology.mp_size), plan)
