"""``deepspeed.comm``'s calls on Python objects, barriers and group membership, with DeepSpeed's
signatures: ``all_gather_object``, ``broadcast_object_list``, ``monitored_barrier``,
``get_all_ranks_from_group``, ``is_available``. The collectives are recorded by the comms logger
under their ``log_name`` (:func:`shardwise.comm.op_logging.timed_op`).

Example:
    >>> every = [None, None]
    >>> # all_gather_object(every, {"rank": rank})  # on each of 2 ranks -> [{'rank': 0}, {'rank': 1}]
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from shardwise.comm.group_type import Group
from shardwise.comm.op_logging import timed_op

__all__ = [
    "all_gather_object",
    "broadcast_object_list",
    "get_all_ranks_from_group",
    "is_available",
    "monitored_barrier",
]


def is_available() -> bool:
    """Whether the communication package can be used: torch was built with ``torch.distributed``."""
    return dist.is_available()


@timed_op
def all_gather_object(
    object_list: list[Any], obj: Any, group: Group = None,
    prof: bool = False, log_name: str = "all_gather_object", debug: str | None = None,
) -> None:
    """Every rank's picklable ``obj`` into ``object_list`` (one entry per rank, in rank order)."""
    dist.all_gather_object(object_list, obj, group=group)


@timed_op
def broadcast_object_list(
    object_list: list[Any], src: int, group: Group = None, device: torch.device | None = None,
    prof: bool = False, log_name: str = "broadcast_object_list", debug: str | None = None,
) -> None:
    """Replace ``object_list``'s entries with rank ``src``'s (picklable objects; ``device`` carries them)."""
    dist.broadcast_object_list(object_list, src, group=group, device=device)


@timed_op
def monitored_barrier(
    group: Group = None, timeout: timedelta | None = None, wait_all_ranks: bool = False,
    prof: bool = False, log_name: str = "monitored_barrier", debug: str | None = None,
) -> None:
    """A barrier that names the ranks that did not arrive within ``timeout`` (gloo groups only, as in torch;
    ``wait_all_ranks``: report every missing rank, not just the first)."""
    dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)


def get_all_ranks_from_group(group: Group = None) -> list[int]:
    """The global ranks of ``group``'s members, in group order (None: every rank of the world)."""
    if group is None:
        return list(range(dist.get_world_size()))
    return dist.get_process_group_ranks(group)
