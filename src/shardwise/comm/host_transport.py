"""Which transport one host's CPU ranks take, and saying so once: shared memory or gloo.

ZeRO's stages 0-2 keep their flat buffers in shared memory and stage 3 stages FSDP2's
collectives there (:mod:`shardwise.comm.shared_memory`) when every rank of the group runs on
this host over gloo; otherwise gloo carries everything. This module is the one place that opens
the shared-memory group for them and the one place that tells the user (rank 0) which transport
was taken and, when a rank could not reserve its buffers, what to do about it: ``zero/`` never
names ``/dev/shm`` or the switch.

Example:
    >>> import torch
    >>> open_host_transport(None, torch.device("cpu"), label="ZeRO stage 1", rank=0, world_size=1) is None
    True
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from shardwise.comm.group_type import Group
from shardwise.comm.shared_memory import ENV_SWITCH, SHM_DIR, SharedMemoryGroup, open_shared_memory
from shardwise.utils.logging import logger

__all__ = ["HostCollectives", "open_host_transport", "report_gloo", "report_shared"]


class HostCollectives(Protocol):
    """Synchronous collectives over flat buffers every rank of one host maps, taking absolute
    ranges of them (:class:`~shardwise.comm.shared_memory.SharedBuffers` implements it): what a
    gradient reducer needs of the shared-memory transport."""

    def all_reduce(self, ranges: Sequence[tuple[int, int]]) -> None:
        """The union of ``ranges`` becomes the sum over the ranks' buffers in every rank's buffer."""
        ...

    def reduce_scatter(
        self, ranges: Sequence[tuple[int, int]], out: torch.Tensor | None = None, accumulate: bool = False
    ) -> None:
        """This rank's range becomes (``out`` receives, or gains with ``accumulate``) its sum over the ranks."""
        ...


def open_host_transport(
    group: Group, device: torch.device, *, label: str, rank: int, world_size: int
) -> SharedMemoryGroup | None:
    """The shared-memory group when every rank of ``group`` runs on this host with ``device``
    (CPU) tensors over gloo; None (gloo) otherwise, saying why (:func:`report_gloo`). Collective
    whenever it can share (two or more ranks on CPU). ``label`` names the caller in the log
    ("ZeRO stage 1")."""
    if world_size < 2 or device.type != "cpu":
        return None
    opened = open_shared_memory(group, device)
    if isinstance(opened, str):
        report_gloo(label, "collectives", opened, rank)
        return None
    return opened


def _reservation_failed(reason: str) -> bool:
    return reason.startswith("rank ") and "could not" in reason


def report_gloo(label: str, subject: str, reason: str, rank: int, *, failed: bool | None = None) -> None:
    """Say (rank 0) that ``subject`` goes through gloo because of ``reason``.

    A rank that could not reserve or map its buffers (``failed``; by default read from
    ``reason``) is a warning that names the fix (more room in ``/dev/shm``, or the switch); any
    other reason is an info line; nothing when the user chose gloo with the switch.
    """
    if rank != 0 or reason.endswith(f"{ENV_SWITCH}=0"):
        return
    if failed if failed is not None else _reservation_failed(reason):
        logger.warning(
            "%s: %s travel through gloo, not shared memory, because %s; give %s more room (docker: --shm-size) "
            "or set %s=0 to choose gloo and silence this",
            label,
            subject,
            reason,
            SHM_DIR,
            ENV_SWITCH,
        )
    else:
        logger.info("%s: collectives through gloo, not shared memory: %s", label, reason)


def report_shared(label: str, world_size: int, detail: str, rank: int, *, extra: str = "") -> None:
    """Say (rank 0) that ``detail`` goes through shared memory, and how to choose gloo instead."""
    if rank == 0:
        logger.info(
            "%s: the %d ranks share this host: %s through shared memory (%s%s=0: through gloo)",
            label,
            world_size,
            detail,
            extra,
            ENV_SWITCH,
        )
