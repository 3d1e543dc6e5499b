"""Stage 3's unsharded parameters (``stage3_param_persistence_threshold``).

Small parameters (biases, norms) cost more as one more thing to gather than they save
when sharded, so they stay whole on every rank, outside FSDP2 (its ``ignored_params``).
This group gives them ZeRO's treatment by hand:

- the module keeps its parameter in the compute dtype; the optimizer steps an fp32
  master (the parameter itself when it is fp32);
- after every backward, the micro step's gradients are flattened into fp32 buckets of
  ``reduce_bucket_size`` elements and all-reduced, then added to fp32 accumulators (the
  same order as the sharded gradients: sum over ranks per micro step, then accumulate);
- after the step, the masters are copied into the parameters.

Every rank holds the same accumulated gradient, so the global norm counts it once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from shardwise.comm import collectives
from shardwise.comm.group_type import Group


class ReplicatedParams:
    """Unsharded trainable parameters with fp32 masters and all-reduced gradients.

    Args:
        params: the module's parameters (trainable, unique).
        process_group: data-parallel group (None: the world).
        world_size: its size.
        bucket_numel: elements per all-reduce.
        comm_dtype: dtype on the wire (None: fp32).
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        process_group: Group,
        world_size: int,
        bucket_numel: int,
        comm_dtype: torch.dtype | None = None,
    ) -> None:
        self.params = list(params)
        self.process_group = process_group
        self.world_size = world_size
        self.bucket_numel = max(1, bucket_numel)
        self.comm_dtype = comm_dtype
        self.masters: list[torch.Tensor] = [
            p.detach() if p.dtype == torch.float32 else p.detach().float().clone() for p in self.params
        ]
        for master in self.masters:
            master.requires_grad_(False)
        self.accumulators: list[torch.Tensor | None] = [None] * len(self.params)
        self.arrived: set[int] = set()  # ids of the parameters that got a gradient this window
        self._buckets = self._plan()

    def _plan(self) -> list[list[int]]:
        buckets: list[list[int]] = []
        current: list[int] = []
        total = 0
        for index, p in enumerate(self.params):
            if current and total + p.numel() > self.bucket_numel:
                buckets.append(current)
                current, total = [], 0
            current.append(index)
            total += p.numel()
        if current:
            buckets.append(current)
        return buckets

    def __len__(self) -> int:
        return len(self.params)

    def master_of(self, param: nn.Parameter) -> torch.Tensor | None:
        """The fp32 master of a parameter of this group."""
        for p, master in zip(self.params, self.masters):
            if p is param:
                return master
        return None

    def reduce_micro_step(self) -> None:
        """All-reduce this backward's gradients and add them to the accumulators."""
        device = self.params[0].device if self.params else torch.device("cpu")
        for bucket in self._buckets:
            numel = sum(self.params[i].numel() for i in bucket)
            wire_dtype = self.comm_dtype or torch.float32
            flat = torch.zeros(numel, dtype=wire_dtype, device=device)
            offset = 0
            for i in bucket:
                p = self.params[i]
                if p.grad is not None:
                    self.arrived.add(id(p))
                    flat[offset : offset + p.numel()].copy_(p.grad.reshape(-1))
                    p.grad = None
                offset += p.numel()
            if self.world_size > 1:
                collectives.all_reduce(flat, op="sum", group=self.process_group)
            offset = 0
            for i in bucket:
                p = self.params[i]
                piece = flat[offset : offset + p.numel()].view_as(p)
                if piece.dtype != torch.float32:
                    piece = piece.float()
                acc = self.accumulators[i]
                if acc is None:
                    # the first micro step's sum is the accumulator itself (a view of this
                    # step's fresh bucket): 0 + x == x, so no copy and no rounding difference
                    self.accumulators[i] = piece
                else:
                    acc.add_(piece)
                offset += p.numel()

    def bind_grads(self) -> None:
        """Point every master's ``.grad`` at its accumulated gradient (zeros if none)."""
        for i, master in enumerate(self.masters):
            acc = self.accumulators[i]
            if acc is None:
                acc = torch.zeros_like(master)
                self.accumulators[i] = acc
            master.grad = acc

    def grads(self) -> list[torch.Tensor]:
        """The accumulated gradients (after :meth:`bind_grads`)."""
        return [a for a in self.accumulators if a is not None]

    def zero_grad(self) -> None:
        """Drop accumulated gradients."""
        self.accumulators = [None] * len(self.params)
        self.arrived.clear()
        for master in self.masters:
            master.grad = None
        for p in self.params:
            p.grad = None

    def publish(self) -> None:
        """Copy updated fp32 masters into the module's parameters."""
        with torch.no_grad():
            for p, master in zip(self.params, self.masters):
                if master.data_ptr() != p.data_ptr():
                    p.copy_(master)

    def refresh_masters(self) -> None:
        """Re-read masters from the parameters (after a broadcast or an edit)."""
        with torch.no_grad():
            for p, master in zip(self.params, self.masters):
                if master.data_ptr() != p.data_ptr():
                    master.copy_(p)

    def state_bytes(self) -> int:
        """Bytes of parameters, separate masters and gradient accumulators."""
        total = 0
        for p, master, acc in zip(self.params, self.masters, self.accumulators):
            total += p.numel() * p.element_size()
            if master.data_ptr() != p.data_ptr():
                total += master.numel() * master.element_size()
            if acc is not None:
                total += acc.numel() * acc.element_size()
        return total
