"""The compressed momentum exchange the 1-bit optimizers share: a list of tensors averaged over
the data-parallel group through one :class:`~shardwise.comm.compressed_allreduce.CompressedAllReduce`.

:class:`OneBitExchange` keeps the group, builds the error-compensated all-reduce on first use
(sized for the concatenation of the tensors), and saves/restores its per-rank error buffers.
With one rank the average is the tensors themselves (nothing is sent).

Example:
    >>> import torch
    >>> exchange = OneBitExchange("Demo")
    >>> t = [torch.ones(3)]
    >>> exchange.average(t); t[0].tolist()   # one process: unchanged
    [1.0, 1.0, 1.0]
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from shardwise.comm import init as comm_init
from shardwise.comm.compressed_allreduce import CompressedAllReduce
from shardwise.comm.group_type import Group

__all__ = ["OneBitExchange"]


class OneBitExchange:
    """1-bit averaging of a fixed list of tensors (flattened into one buffer) across a group.

    Args:
        owner: the optimizer's name, for errors.
    """

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.group: Group = None
        self.world_size = 1
        self._reduce: CompressedAllReduce | None = None
        self._pending: dict[str, object] | None = None

    def attach(self, group: Group) -> None:
        """Average over ``group`` (None: the world; one rank when torch.distributed is not up)."""
        self.group = group
        self.world_size = comm_init.get_world_size(group) if comm_init.is_initialized() else 1

    def average(self, tensors: list[Tensor]) -> None:
        """Replace every rank's ``tensors`` by their compressed average, in place (collective)."""
        if self.world_size == 1 or not tensors:
            return
        flat = torch.cat([t.reshape(-1).float() for t in tensors])
        self._for(flat.numel(), flat.device).average(flat)
        offset = 0
        for t in tensors:
            t.view(-1).copy_(flat[offset : offset + t.numel()])
            offset += t.numel()

    def reset_errors(self) -> None:
        """Zero the error buffers (0/1 Adam does when its variance freezes)."""
        if self._reduce is not None:
            self._reduce.worker_error.zero_()
            self._reduce.server_error.zero_()
        self._pending = None

    def _for(self, numel: int, device: torch.device) -> CompressedAllReduce:
        if self._reduce is None:
            self._reduce = CompressedAllReduce(numel, device=device, group=self.group)
            if self._pending is not None:
                self._reduce.load_state_dict(self._pending)
                self._pending = None
        if self._reduce.numel != numel:
            raise RuntimeError(
                f"{self.owner}: the parameters with gradients changed from {self._reduce.numel} to {numel} "
                "elements; 1-bit compression needs every parameter to get a gradient on every step"
            )
        return self._reduce

    def state_dict(self) -> dict[str, Any] | None:
        """This rank's error buffers (None before the first exchange)."""
        if self._reduce is not None:
            return self._reduce.state_dict()
        return self._pending

    def load_state_dict(self, state: dict[str, object] | None) -> None:
        """Restore :meth:`state_dict` (applied when the all-reduce is built; None: start at zero)."""
        self._reduce = None
        self._pending = state
