"""Every rank's picklable value, on every rank: the one gather of Python objects outside the tensor paths.

The bookkeeping that travels as Python values rather than tensors (the data loader adapter's
batch entries, the resume candidates each rank sees, checkpoint file records, a failed rank's
error message) is gathered here with torch's ``all_gather_object``, so no package outside
``comm/`` calls ``torch.distributed`` for it. A group of one rank (or no process group) is an
identity: no collective is made.

Example:
    >>> all_gather_objects({"step": 3}, None)  # one process, no process group
    [{'step': 3}]
"""

from __future__ import annotations

import torch.distributed as dist

from shardwise.comm.group_type import Group

__all__ = ["all_gather_objects"]


def all_gather_objects(value: object, group: Group) -> list[object]:
    """Every rank's picklable ``value``, in rank order."""
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    if world == 1:
        return [value]
    every: list[object] = [None] * world
    dist.all_gather_object(every, value, group=group)
    return every
