"""``deepspeed.constants``: the environment names and default port of a launched process.

The launcher (:mod:`shardwise.launcher`) exports ``CROSS_RANK`` (the node's index) and
``CROSS_SIZE`` (the node count) next to ``LOCAL_RANK`` in every worker's environment, and its
rendezvous port defaults to :data:`TORCH_DISTRIBUTED_DEFAULT_PORT`; these are DeepSpeed's names
for them.
"""

from __future__ import annotations

CROSS_RANK = "CROSS_RANK"
CROSS_SIZE = "CROSS_SIZE"
LOCAL_RANK = "LOCAL_RANK"
TORCH_DISTRIBUTED_DEFAULT_PORT = 29500
"""The rendezvous port when none is given (``--master_port``, ``init_distributed(distributed_port=)``)."""

__all__ = ["CROSS_RANK", "CROSS_SIZE", "LOCAL_RANK", "TORCH_DISTRIBUTED_DEFAULT_PORT"]
