"""Flat buffers for one group of trainable parameters (one optimizer param group, one dtype).

After construction every parameter's ``.data`` is a view into ``param_buffer``, so the
model computes on the buffer directly and an update of the buffer is an update of the
model, with no copies. Per bucket the group keeps:

- ``master[b]``: the fp32 values this rank optimises (its shard of bucket ``b``, or the
  whole bucket at stage 0). For fp32 models it is a view into ``param_buffer``; for
  16-bit models it is a separate fp32 copy (the master weights).
- ``grad[b]``: the reduced gradient for ``master[b]``, in the accumulation dtype.

Stages 0 and 1 also keep a full-size ``grad_buffer`` that gradients accumulate into
between reductions; stage 2 keeps only the shard gradients (the memory saving).

The buffers that travel come from the group's
:class:`~shardwise.comm.host_transport.HostTransport` (``param_store``: the sharded parameter
buffer the updated shards are gathered in, stages 1-2; ``grad_store``: the full gradient buffer,
stages 0-1; ``staging``: stage 2's per-bucket gradient buffers, holding memory only from a micro
step's first gradient until the bucket is reduced), which also carries their collectives; the
group never asks which transport that is.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from shardwise.comm.flat_buffers import FlatBuffer, PrivateBuffer
from shardwise.comm.host_transport import GlooTransport, HostTransport
from shardwise.zero.partition import FlatLayout, plan_layout


class FlatGroup:
    """The flat parameter/gradient/master buffers of one parameter group."""

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        *,
        rank: int,
        world_size: int,
        bucket_numel: int,
        shard: bool,
        full_grad_buffer: bool,
        grad_dtype: torch.dtype,
        align: int = 1,
        transport: HostTransport | None = None,
    ) -> None:
        if not params:
            raise ValueError("a FlatGroup needs at least one parameter")
        dtypes = {p.dtype for p in params}
        devices = {p.device for p in params}
        assert len(dtypes) == 1 and len(devices) == 1, f"rank{rank}: mixed dtypes/devices {dtypes} {devices}"
        self.params = list(params)
        self.dtype = params[0].dtype
        self.device = params[0].device
        self.rank = rank
        self.world_size = world_size
        self.shard = shard
        self.grad_dtype = grad_dtype
        self.layout: FlatLayout = plan_layout([p.numel() for p in params], world_size, bucket_numel, align)
        total = self.layout.total_numel
        transport = transport if transport is not None else GlooTransport(None, rank, world_size)
        # the parameter buffer travels where shards are published (stages 1-2); stage 0's stays private
        self.param_store: FlatBuffer = (
            transport.allocate(total, self.dtype, self.device)
            if shard
            else PrivateBuffer(total, self.dtype, self.device, group=None, rank=rank, world=world_size)
        )
        self.param_buffer = self.param_store.mine
        with torch.no_grad():
            for slot, p in zip(self.layout.slots, self.params):
                view = self.param_buffer[slot.offset : slot.offset + slot.numel]
                view.copy_(p.detach().reshape(-1))
                p.data = view.view_as(p)
        self.grad_buffer: torch.Tensor | None = None
        self.grad_store: FlatBuffer | None = None
        self.staging: list[FlatBuffer] = []
        if full_grad_buffer:
            self.grad_store = transport.allocate(total, grad_dtype, self.device)
            self.grad_buffer = self.grad_store.mine
        else:
            # stage 2: each bucket's micro-step gradients in a buffer of its own, reserved by the
            # reducer at the bucket's first gradient and released once the bucket is reduced
            numels = [plan.numel for plan in self.layout.buckets]
            self.staging = transport.allocate_staging(numels, grad_dtype, self.device)
        self.owned = [self.owned_range(b) for b in range(len(self.layout.buckets))]
        self.master: list[torch.Tensor] = []
        self.grad: list[torch.Tensor] = []
        self._master_flat: torch.Tensor | None = None
        if not shard:
            # Unsharded (stage 0): the optimizer sees one tensor per parameter, so
            # optimizers with per-tensor maths (Lamb's trust ratio) stay exact.
            assert self.grad_buffer is not None, "unsharded groups keep a full gradient buffer"
            master_flat = self.param_buffer if self.dtype == torch.float32 else self.param_buffer.float()
            self._master_flat = master_flat
            for index, p in enumerate(self.params):
                lo, hi = self.param_view(index)
                self.master.append(master_flat[lo:hi].view_as(p))
                self.grad.append(self.grad_buffer[lo:hi].view_as(p))
        else:
            # Sharded (stages 1-2): one tensor per bucket shard, updated with one fused kernel.
            for lo, hi in self.owned:
                if self.dtype == torch.float32:
                    self.master.append(self.param_buffer[lo:hi])
                else:
                    self.master.append(self.param_buffer[lo:hi].detach().float())
                if self.grad_buffer is not None:
                    self.grad.append(self.grad_buffer[lo:hi])
                else:
                    self.grad.append(torch.zeros(hi - lo, dtype=grad_dtype, device=self.device))
        # Stages 0/1 with matching dtypes: after the first micro step of a window, autograd
        # accumulates straight into the flat gradient buffer (param.grad is a view), so
        # accumulation costs no copy at all.
        self.grads_are_views = self.grad_buffer is not None and grad_dtype == self.dtype
        # Which parameters' slots of the full gradient buffer hold this window's gradient.
        # A new window does not zero the buffer: the first gradient of each parameter is
        # copied in (autograd hands it over as a fresh tensor, since param.grad is None),
        # later ones are added, and slots nobody wrote are zeroed only when the buffer is
        # read (``settle``). That saves a memset and a read of the whole buffer per window;
        # copy == 0 + x exactly, so results do not change.
        self._written = [False] * len(self.params)

    # ------------------------------------------------------------------ layout helpers
    def owned_range(self, bucket: int) -> tuple[int, int]:
        """The part of ``bucket`` this rank optimises: its shard, or all of it without sharding."""
        plan = self.layout.buckets[bucket]
        return plan.shard_range(self.rank) if self.shard else (plan.start, plan.end)

    def param_view(self, index: int) -> tuple[int, int]:
        """``[start, end)`` of parameter ``index`` in the flat buffer."""
        slot = self.layout.slots[index]
        return slot.offset, slot.offset + slot.numel

    def master_pieces(self, index: int) -> list[tuple[int, int, int, int]]:
        """Where parameter ``index``'s fp32 values live among ``master`` (for checkpoints).

        Returns ``(start, stop, bucket_master, offset)`` tuples: flattened elements
        ``[start, stop)`` of the parameter are ``master[bucket_master][offset : offset + stop - start]``
        (viewed 1-D). Unsharded groups hold every parameter whole; sharded groups hold the part
        of it inside this rank's shard of its bucket, possibly nothing.
        """
        slot = self.layout.slots[index]
        if not self.shard:
            return [(0, slot.numel, index, 0)]
        lo, hi = self.owned[slot.bucket]
        start, stop = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
        if start >= stop:
            return []
        return [(start - slot.offset, stop - slot.offset, slot.bucket, start - lo)]

    # ------------------------------------------------------------------ gradients
    def fold_grad(self, index: int, grad: torch.Tensor) -> None:
        """Put parameter ``index``'s new gradient into the full gradient buffer: copied if
        it is the window's first for this parameter, added otherwise. With views, the
        parameter's ``.grad`` then points at its slot (autograd adds there from now on)."""
        assert self.grad_buffer is not None, "fold_grad needs the full gradient buffer (stages 0-1)"
        lo, hi = self.param_view(index)
        slot = self.grad_buffer[lo:hi]
        if self._written[index]:
            slot.add_(grad.reshape(-1))
        else:
            slot.copy_(grad.reshape(-1))
            self._written[index] = True
        param = self.params[index]
        param.grad = slot.view_as(param) if self.grads_are_views else None

    def settle(self, bucket: int | None = None) -> None:
        """Zero the slots (of one bucket, or all) of the full gradient buffer that no
        gradient reached in this window, before the buffer is reduced or read."""
        if self.grad_buffer is None:
            return
        indices = range(len(self.params)) if bucket is None else self.layout.buckets[bucket].param_indices
        for index in indices:
            if not self._written[index]:
                lo, hi = self.param_view(index)
                self.grad_buffer[lo:hi].zero_()
                self._written[index] = True

    def gradient_slot(self, index: int) -> torch.Tensor:
        """Parameter ``index``'s accumulated gradient of this window, as a view of the full
        gradient buffer shaped like the parameter (zeroed first if no gradient reached it)."""
        assert self.grad_buffer is not None, "gradient_slot needs the full gradient buffer (stages 0-1)"
        lo, hi = self.param_view(index)
        if not self._written[index]:
            self.grad_buffer[lo:hi].zero_()
            self._written[index] = True
        return self.grad_buffer[lo:hi].view_as(self.params[index])

    def zero_grads(self) -> None:
        """Start a new accumulation window: every parameter's ``.grad`` is None until its
        first gradient arrives (see ``fold_grad``); sharded accumulators are zeroed."""
        if self.grad_buffer is None:
            for g in self.grad:
                g.zero_()
        self._written = [False] * len(self.params)
        for p in self.params:
            p.grad = None

    def master_params(self) -> list[torch.Tensor]:
        """The tensors the optimizer updates, one per bucket."""
        return self.master

    # ------------------------------------------------------------------ after the step
    def copy_master_to_params(self, bucket: int | None = None) -> None:
        """Write updated fp32 masters (of one bucket, or all) into the (16-bit) parameter
        buffer's owned ranges."""
        if self.dtype == torch.float32:
            return  # masters are views of the parameter buffer
        if self._master_flat is not None:
            self.param_buffer.copy_(self._master_flat)  # unsharded: one tensor per parameter, all at once
            return
        chosen = range(len(self.owned)) if bucket is None else (bucket,)
        for b in chosen:
            lo, hi = self.owned[b]
            self.param_buffer[lo:hi].copy_(self.master[b])

    def state_bytes(self) -> int:
        """Bytes held by this group's persistent buffers (params, grads, masters)."""
        total = self.param_buffer.numel() * self.param_buffer.element_size()
        if self.grad_buffer is not None:
            total += self.grad_buffer.numel() * self.grad_buffer.element_size()
        else:
            total += sum(g.numel() * g.element_size() for g in self.grad)
        if self.dtype != torch.float32:
            total += sum(m.numel() * m.element_size() for m in self.master)
        return total

    def local_master_flat(self) -> torch.Tensor:
        """A full-size fp32 buffer holding this rank's master values, zeros where other
        ranks own the values (summing it over ranks gives every master exactly)."""
        if self._master_flat is not None:
            return self._master_flat.float().clone()
        full = torch.zeros(self.layout.total_numel, dtype=torch.float32, device=self.device)
        for (lo, hi), master in zip(self.owned, self.master):
            full[lo:hi] = master
        return full

    def refresh_masters(self) -> None:
        """Re-read fp32 masters from the parameter buffer (after a broadcast or a load)."""
        if self.dtype == torch.float32:
            return
        if self._master_flat is not None:
            self._master_flat.copy_(self.param_buffer)
            return
        for (lo, hi), master in zip(self.owned, self.master):
            master.copy_(self.param_buffer[lo:hi])
