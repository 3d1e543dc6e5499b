"""The one spelling of "a process group" in signatures: :data:`Group`.

``None`` means the world group (torch's convention), so a :data:`Group` can be passed
straight to any collective in :mod:`shardwise.comm`.

Example:
    >>> from shardwise.comm.group_type import Group
    >>> def world_only(group: Group = None) -> bool:
    ...     return group is None
    >>> world_only()
    True
"""

from __future__ import annotations

from typing import TypeAlias

from torch.distributed import ProcessGroup

__all__ = ["Group", "ProcessGroup"]

Group: TypeAlias = ProcessGroup | None
"""A process group, or None for the world group."""
