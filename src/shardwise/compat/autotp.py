"""``deepspeed.module_inject.layers`` / ``tp_shard`` names over :mod:`shardwise.tensor_parallel`.

``LinearLayer`` (column-parallel) and ``LinearAllreduce`` (row-parallel) are shardwise's layers
themselves (they take DeepSpeed's ``(module, mp_group, ...)`` arguments), so ``isinstance`` checks
on a split model hold. ``set_autotp_mode`` / ``is_autotp_training_mode`` keep DeepSpeed's mode flag
(shardwise's tensor parallelism is for training; ``tp_model_init`` turns the flag on).
"""

from __future__ import annotations

from typing import Any

from shardwise.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from shardwise.tensor_parallel.model_init import is_autotp_training_mode, set_autotp_mode
from shardwise.tensor_parallel.shards import shard_sizes

__all__ = [
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
