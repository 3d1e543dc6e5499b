"""Stages 0-2 on one host: whether the flat buffers go to shared memory, and saying so.

:func:`open_for_groups` opens a :class:`~shardwise.comm.shared_memory.SharedMemoryGroup` for
the data-parallel group when every rank runs on this host with CPU tensors over gloo;
:class:`~shardwise.zero.flat_group.FlatGroup` then allocates its buffers from it.
:func:`log_transport` tells the user (rank 0) which transport the gradients and parameters
took, and, when a rank could not reserve its buffers, why and what to do (the wording, and the
choice of shared memory or gloo, are :mod:`shardwise.comm.host_transport`'s).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from shardwise.comm.group_type import Group
from shardwise.comm.host_transport import open_host_transport, report_gloo, report_shared
from shardwise.comm.shared_memory import SharedMemoryGroup
from shardwise.zero.flat_group import FlatGroup


def open_for_groups(
    param_groups: Sequence[dict[str, Any]], process_group: Group, world_size: int, stage: int, rank: int
) -> SharedMemoryGroup | None:
    """Shared-memory buffers when every rank runs on this host with the (trainable) parameters
    on the CPU over gloo; None otherwise (``comm.host_transport`` says why)."""
    devices = {p.device for group in param_groups for p in group["params"] if p.requires_grad}
    device = torch.device("cpu") if devices <= {torch.device("cpu")} else next(iter(devices))
    return open_host_transport(
        process_group, device, label=f"ZeRO stage {stage}", rank=rank, world_size=world_size
    )


def log_transport(groups: Sequence[FlatGroup], stage: int, rank: int, world_size: int) -> None:
    """Say (rank 0) whether the buffers went to shared memory, and why not if they could not."""
    refused = next((flat.not_shared for flat in groups if flat.not_shared), None)
    if refused is not None:
        report_gloo(f"ZeRO stage {stage}", "gradients and parameters", refused, rank, failed=True)
    elif any(flat.shared_params is not None or flat.shared_grads is not None for flat in groups):
        detail = {0: "gradients are all-reduced", 1: "gradients are reduced and parameters gathered"}.get(
            stage,
            "gradients are reduced (staged in a buffer of one bucket, given back after each reduction) "
            "and parameters gathered"
            if all(flat.shared_staging is not None for flat in groups)
            else "parameters are gathered (stage 2 reduces its gradient buckets through gloo: the model "
            "does not fit in one reduce_bucket_size)",
        )
        report_shared(f"ZeRO stage {stage}", world_size, detail, rank)
