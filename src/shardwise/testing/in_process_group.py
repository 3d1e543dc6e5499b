"""Tearing down a process group a test created in its own process (an in-process ``initialize`` of a
world of one), with shardwise's layout and the environment ``init_distributed`` exported, so the
tests after it start clean."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

__all__ = ["torn_down_process_group"]

_EXPORTED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@contextlib.contextmanager
def torn_down_process_group() -> Iterator[None]:
    """Run the block; if it created the default process group, destroy it, reset the mesh layout and
    topology, and restore the variables ``init_distributed`` exports."""
    import torch.distributed as dist

    before = {name: os.environ.get(name) for name in _EXPORTED}
    had_group = dist.is_initialized()
    try:
        yield
    finally:
        if not had_group and dist.is_initialized():
            from shardwise.comm import groups, mesh
            from shardwise.comm.init import destroy_process_group

            mesh.reset_layout()
            groups.clear_topology()
            destroy_process_group()
            for name, value in before.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
