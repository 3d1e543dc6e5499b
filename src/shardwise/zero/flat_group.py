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

With a :class:`~shardwise.comm.shared_memory.SharedMemoryGroup` (all ranks on one host, CPU,
gloo) the (sharded) parameter buffer and the full gradient buffer live in shared memory, every rank's
mapped in every rank (``shared_params``, ``shared_grads``), so reductions and gathers are reads
of the other ranks' buffers instead of gloo transfers. At stage 2 (no full gradient buffer) a group
that fits in one reduce bucket stages each micro step's gradients in a shared buffer of that
bucket's size instead (``shared_staging``), whose memory is given back after each reduction and
taken again by the next backward, so between steps stage 2 holds no full-size gradient buffer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from shardwise.comm.shared_memory import SharedBuffers, SharedMemoryGroup
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
        shared: SharedMemoryGroup | None = None,
        shared_staging: bool = False,
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
        # shared-memory buffers (None: private ones): the parameters where shards are published
        # (stages 1-2), the full gradient buffer (stages 0-1); why not, if the group could not
        self.not_shared: str | None = None
        self.shared_grads: SharedBuffers | None = None
        self.shared_staging: SharedBuffers | None = None
        self.shared_params: SharedBuffers | None = self._allocate_shared(
            shared if shard else None, total, self.dtype
        )
        self.param_buffer = (
            self.shared_params.mine
            if self.shared_params is not None
            else torch.zeros(total, dtype=self.dtype, device=self.device)
        )
        with torch.no_grad():
            for slot, p in zip(self.layout.slots, self.params):
                view = self.param_buffer[slot.offset : slot.offset + slot.numel]
                view.copy_(p.detach().reshape(-1))
                p.data = view.view_as(p)
        self.grad_buffer: torch.Tensor | None = None
        if full_grad_buffer:
            self.shared_grads = self._allocate_shared(shared, total, grad_dtype)
            self.grad_buffer = (
                self.shared_grads.mine
                if self.shared_grads is not None
                else torch.zeros(total, dtype=grad_dtype, device=self.device)
            )
        elif shared_staging and len(self.layout.buckets) == 1:
            # stage 2 with the whole group in one reduce bucket: the bucket's micro-step gradients
            # are staged in shared memory, each rank summing its shard from every rank's staging
            # buffer; released between reductions (the reducer calls release/reserve)
            self.shared_staging = self._allocate_shared(shared, total, grad_dtype, releasable=True)
            if self.shared_staging is not None:
                self.shared_staging.release()
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

    def _allocate_shared(
        self, shared: SharedMemoryGroup | None, numel: int, dtype: torch.dtype, releasable: bool = False
    ) -> SharedBuffers | None:
        """Zero-filled shared buffers from ``shared`` (collective), or None (then ``not_shared``
        says why, if ``shared`` was given)."""
        if shared is None:
            return None
        got = shared.allocate(numel, dtype, releasable=releasable)
        if isinstance(got, str):
            self.not_shared = got
            return None
        return got

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
