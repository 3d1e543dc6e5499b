"""Test helpers: run code on several spawned ``torch.distributed`` ranks on one machine.

Importing this package does not import torch; the ranks import it themselves.

Example:
    >>> from shardwise.testing import run_distributed
    >>> # def _rank_plus_one(rank, world_size): return rank + 1   (at module level)
    >>> # run_distributed(_rank_plus_one, world_size=2)
    >>> # -> [1, 2]
"""

from __future__ import annotations

from shardwise.testing.multiprocess import (
    DistributedTestError,
    find_free_port,
    run_distributed,
    run_distributed_cases,
)

__all__ = [
    "DistributedTestError",
    "find_free_port",
    "run_distributed",
    "run_distributed_cases",
]
