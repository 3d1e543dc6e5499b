"""Gradient reduction in buckets, fired from autograd hooks during backward.

Each trainable parameter gets a post-accumulate-grad hook. When the last parameter of
a bucket has its gradient, the bucket's reduction is launched asynchronously, so
communication overlaps the rest of backward (``overlap_comm``); without overlap the
buckets are reduced in order when backward ends. ``finish()`` (called by the engine
after backward and again, idempotently, before the optimizer step) launches buckets
whose parameters got no gradient (their gradient is zero) and waits for everything.

Stage 0 all-reduces each bucket; stages 1 and 2 reduce-scatter it, so each rank keeps
the sum for its own shard only. Stages 0/1 reduce at the accumulation boundary only;
stage 2 reduces every micro step into its shard accumulators.

Reduction is progressive where it costs no extra memory, whatever ``overlap_comm`` says
(DeepSpeed's ``overlap_comm: false`` exists to save the extra buffers its overlap needs):
parameters sit in a bucket in reverse registration order, the order backward produces
their gradients, and a bucket is cut into pieces of about ``CHUNK_NUMEL`` elements at
parameter boundaries (the way DDP's 25 MB buckets overlap); each piece is reduced as soon
as its gradients are in. Stage 0 all-reduces the pieces in place in its flat gradient
buffer. Stages 1 and 2 do so where the reduce-scatter is an exchange between the shard
owners (gloo groups of two ranks, see :func:`shardwise.comm.collectives.choose_algorithm`
and :mod:`shardwise.comm.exchange`): a piece may cut across shards, and each rank receives
the sums of its own part of it (stage 2 adds them to its shard accumulator). Stage 1 also
goes progressive where its reduce-scatter is an in-place all-reduce.

Every rank issues the same collectives in the same order, whatever order its hooks fire
in (a rank may skip a parameter another rank uses): the pieces (or whole buckets) form
one fixed sequence, and a piece is launched only after every piece before it, as DDP
does. Pieces still incomplete when backward ends go then, in sequence. Launching early
is learned: the first backward only observes, and a model in which a parameter receives
two gradients in one backward (reentrant activation checkpointing of a shared weight)
keeps reducing after backward, because the second gradient would land in a piece
already on the wire.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from shardwise.comm import collectives
from shardwise.utils.logging import logger
from shardwise.zero.flat_group import FlatGroup


@dataclass(frozen=True)
class ReducePolicy:
    """How gradients travel: derived once from the config.

    Attributes:
        shard: reduce-scatter (stages 1-2) instead of all-reduce (stage 0).
        every_micro_step: reduce on every backward (stage 2) rather than at the boundary.
        overlap: launch a bucket as soon as it is complete (``overlap_comm``).
        comm_dtype: dtype on the wire (``communication_data_type``), None = gradient dtype.
        pre_multiplier: applied before the reduction (prescale 1/W or predivide 1/f), 1.0 = none.
    """

    shard: bool
    every_micro_step: bool
    overlap: bool
    comm_dtype: torch.dtype | None
    pre_multiplier: float


# Progressive reduction: reduce the finished part of a bucket once it holds this many
# elements (DDP's default bucket: 25 MiB of fp32).
CHUNK_NUMEL = 25 * 2**20 // 4


@dataclass(frozen=True)
class _Unit:
    """One reduction of the fixed launch sequence: ``[start, end)`` of a bucket's buffer,
    complete when every parameter in ``params`` has its gradient."""

    group: int
    bucket: int
    start: int
    end: int
    params: tuple[int, ...]


@dataclass
class _Inflight:
    work: Any
    after: Callable[[], None]


def _reduce_scatter_algorithm(groups: list[FlatGroup], process_group: Any) -> str:
    """How this group's in-place reduce-scatter runs (see ``collectives.choose_algorithm``)."""
    import torch.distributed as dist

    if not groups or not dist.is_initialized():
        return "native"
    return collectives.choose_algorithm(
        "reduce_scatter",
        str(dist.get_backend(process_group)),
        groups[0].device.type,
        0,
        input_is_scratch=True,
        world_size=dist.get_world_size(process_group),
    )


class GradientReducer:
    """Owns the hooks and the in-flight reductions of a set of flat groups."""

    def __init__(self, groups: list[FlatGroup], policy: ReducePolicy, process_group: Any = None) -> None:
        self.groups = groups
        self.policy = policy
        self.process_group = process_group
        self.reduce_this_backward = True  # set by the engine before each backward
        self.sync_enabled = True  # False inside no_sync()
        self._fresh: list[list[bool]] = [[True] * len(g.layout.buckets) for g in groups]
        self._bucket_buffers: dict[tuple[int, int], torch.Tensor] = {}
        self._bucket_written: dict[tuple[int, int], set[int]] = {}
        self._inflight: list[_Inflight] = []
        self._active = False
        self._expected_ptr: list[list[int]] = []
        # Progressive reduction in pieces while backward runs: stage 0 all-reduces pieces of
        # the full gradient buffer; stages 1-2 exchange pieces between the shard owners
        # (where exchange is the measured choice) or, at stage 1, all-reduce them. Else
        # whole buckets.
        algorithm = _reduce_scatter_algorithm(groups, process_group) if policy.shard else "all_reduce"
        self._piece_exchange = policy.shard and algorithm == "exchange"
        full_buffers = all(g.grad_buffer is not None for g in groups)
        self._progressive = self._piece_exchange or (full_buffers and algorithm == "all_reduce")
        self._units = self._plan_units()
        self._unit_of = {(u.group, pi): k for k, u in enumerate(self._units) for pi in u.params}
        self._bucket_ends = {  # units that end a bucket
            k
            for k, u in enumerate(self._units)
            if k + 1 == len(self._units)
            or (self._units[k + 1].group, self._units[k + 1].bucket) != (u.group, u.bucket)
        }
        self._early = False  # may reductions start before backward ends? (learned, see _on_grad)
        self._learned = False
        self._repeats_seen = False
        self._arrived: set[tuple[int, int]] = set()  # this backward's (group, param) gradients
        self._missing: list[int] = []
        self._next_unit = 0
        self._reset_counts()
        self._handles = []
        for gi, group in enumerate(groups):
            self._expected_ptr.append(
                [
                    group.grad_buffer[group.param_view(i)[0] :].data_ptr() if group.grads_are_views else 0  # type: ignore[index]
                    for i in range(len(group.params))
                ]
            )
            for pi, param in enumerate(group.params):
                self._handles.append(param.register_post_accumulate_grad_hook(self._make_hook(gi, pi)))

    # ------------------------------------------------------------------ state per backward
    def _plan_units(self) -> list[_Unit]:
        """The fixed launch sequence: every bucket of every group in order, cut into pieces
        of about ``CHUNK_NUMEL`` elements at parameter boundaries when progressive."""
        units: list[_Unit] = []
        for gi, group in enumerate(self.groups):
            for b, plan in enumerate(group.layout.buckets):
                order = sorted(plan.param_indices, key=lambda i: group.layout.slots[i].offset)
                if not self._progressive:
                    units.append(_Unit(gi, b, plan.start, plan.end, tuple(order)))
                    continue
                start, members = plan.start, []
                for pi in order:
                    members.append(pi)
                    end = group.param_view(pi)[1]
                    if end - start >= CHUNK_NUMEL and pi != order[-1]:
                        units.append(_Unit(gi, b, start, end, tuple(members)))
                        start, members = end, []
                units.append(_Unit(gi, b, start, plan.end, tuple(members)))
        return units

    def _reset_counts(self) -> None:
        self._missing = [len(u.params) for u in self._units]
        self._next_unit = 0

    def _reducing(self) -> bool:
        return self.sync_enabled and (self.policy.every_micro_step or self.reduce_this_backward)

    def remove_hooks(self) -> None:
        """Detach every hook (used when the engine is destroyed)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # ------------------------------------------------------------------ hooks
    def _make_hook(self, gi: int, pi: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            self._on_grad(gi, pi, param)

        return hook

    def _accumulate(self, gi: int, pi: int, param: torch.Tensor) -> None:
        """Move ``param.grad`` into the group's buffers (unless autograd already did)."""
        group = self.groups[gi]
        grad = param.grad
        if grad is None:
            return
        if group.grads_are_views and grad.data_ptr() == self._expected_ptr[gi][pi]:
            return  # accumulated in place by autograd
        if group.grad_buffer is not None:
            # the window's first gradient (autograd handed over a fresh tensor), a 16-bit
            # gradient for a wider buffer, or a .grad someone replaced: fold it in
            group.fold_grad(pi, grad)
            return
        lo, hi = group.param_view(pi)
        bucket = group.layout.slots[pi].bucket
        buf = self._bucket_buffer(gi, bucket)
        start = group.layout.buckets[bucket].start
        written = self._bucket_written[(gi, bucket)]
        if pi in written:
            buf[lo - start : hi - start].add_(grad.reshape(-1))
        else:
            buf[lo - start : hi - start].copy_(grad.reshape(-1))  # no zero-fill, no read
            written.add(pi)
        param.grad = None

    def _on_grad(self, gi: int, pi: int, param: torch.Tensor) -> None:
        self._active = True
        repeat = (gi, pi) in self._arrived
        self._arrived.add((gi, pi))
        self._accumulate(gi, pi, param)
        if repeat:
            self._on_repeat(gi, pi)
        if not self._reducing() or repeat:
            return
        unit = self._unit_of[(gi, pi)]
        self._missing[unit] -= 1
        if self._early and (self._progressive or self.policy.overlap):
            self._launch_ready_units()

    def _on_repeat(self, gi: int, pi: int) -> None:
        """A parameter got a second gradient in this backward (autograd just added it)."""
        if self._reducing() and self._unit_of[(gi, pi)] < self._next_unit:
            raise RuntimeError(
                f"parameter {pi} of group {gi} (shape {tuple(self.groups[gi].params[pi].shape)}) received a second "
                "gradient in one backward after its gradients were already being reduced. This happens with "
                "reentrant activation checkpointing (torch.utils.checkpoint(use_reentrant=True)) of a weight "
                "used in several checkpointed segments, when that only happens in some steps. Use "
                "use_reentrant=False, or call backward once per micro step."
            )
        if self._early:
            logger.warning(
                "a parameter receives more than one gradient per backward (reentrant activation checkpointing "
                "of a shared weight?): gradients are now reduced after backward instead of during it"
            )
        self._repeats_seen = True
        self._early = False

    def _launch_ready_units(self) -> None:
        """Launch complete units in sequence order (never one before an earlier one)."""
        while self._next_unit < len(self._units) and self._missing[self._next_unit] == 0:
            self._launch_unit(self._next_unit)
            self._next_unit += 1

    def _launch_unit(self, k: int) -> None:
        unit = self._units[k]
        if not self._progressive:
            self._launch(unit.group, unit.bucket)
            return
        group = self.groups[unit.group]
        if group.grad_buffer is None:  # stage 2: a piece of this micro step's bucket buffer
            self._launch_shard_piece(unit, last=k in self._bucket_ends)
            return
        if self._missing[k]:
            group.settle(unit.bucket)  # slots no gradient reached in this window
        self._launch_range(unit.group, unit.bucket, unit.start, unit.end)

    # ------------------------------------------------------------------ buckets
    def _bucket_buffer(self, gi: int, bucket: int) -> torch.Tensor:
        """This micro step's gradient buffer of a bucket (stage 2): uninitialised; each
        parameter's slot is written by its first gradient, the rest zeroed at launch."""
        key = (gi, bucket)
        buf = self._bucket_buffers.get(key)
        if buf is None:
            group = self.groups[gi]
            buf = torch.empty(group.layout.buckets[bucket].numel, dtype=group.grad_dtype, device=group.device)
            self._bucket_buffers[key] = buf
            self._bucket_written[key] = set()
        return buf

    def _settle_bucket_buffer(self, gi: int, bucket: int, buf: torch.Tensor) -> None:
        """Zero what no gradient wrote in a bucket buffer: slots and end padding."""
        plan = self.groups[gi].layout.buckets[bucket]
        written = self._bucket_written.pop((gi, bucket), set())
        self._zero_unwritten(gi, bucket, buf, (plan.start, plan.end), plan.param_indices, written)

    def _zero_unwritten(
        self,
        gi: int,
        bucket: int,
        buf: torch.Tensor,
        span: tuple[int, int],
        params: tuple[int, ...],
        written: set[int],
    ) -> None:
        """Zero the part ``span`` (flat coordinates, holding ``params`` in offset order) of a
        bucket buffer where no gradient was written: padding, and slots not in ``written``."""
        group = self.groups[gi]
        base = group.layout.buckets[bucket].start
        position = span[0]
        for pi in params:
            lo, hi = group.param_view(pi)
            if lo > position:
                buf[position - base : lo - base].zero_()
            if pi not in written:
                buf[lo - base : hi - base].zero_()
            position = hi
        if position < span[1]:
            buf[position - base : span[1] - base].zero_()

    def _launch_range(self, gi: int, bucket: int, start: int, end: int) -> None:
        """Reduce ``grad_buffer[start:end]`` (a finished part of a bucket) in place: all-reduce
        it (stage 0), or at stage 1 bring each rank the sums of its shard's part of it
        (exchange; or all-reduce, after which this rank reads its shard)."""
        if end <= start:
            return
        group = self.groups[gi]
        assert group.grad_buffer is not None
        source = group.grad_buffer[start:end]
        wire = self._wire(source)
        work: Any
        if self._piece_exchange:
            owned = self._owned_in(gi, bucket, start, end)
            work = collectives.reduce_scatter_ranges(wire, owned, self.process_group, async_op=True)
            mine = slice(*owned[group.rank])
        else:
            work = collectives.all_reduce(wire, op="sum", group=self.process_group, async_op=True)
            mine = slice(None)

        def after() -> None:
            if wire is not source:
                source[mine].copy_(wire[mine])

        self._inflight.append(_Inflight(work, after))

    def _wire(self, source: torch.Tensor) -> torch.Tensor:
        """What goes on the wire for ``source``: itself, or a copy in ``communication_data_type``;
        pre-scaled (prescale / predivide) in place."""
        policy = self.policy
        wire = source if policy.comm_dtype in (None, source.dtype) else source.to(policy.comm_dtype)
        if policy.pre_multiplier != 1.0:
            wire.mul_(policy.pre_multiplier)
        return wire

    def _owned_in(self, gi: int, bucket: int, start: int, end: int) -> list[tuple[int, int]]:
        """Each rank's shard of ``bucket`` within ``[start, end)``, relative to ``start``."""
        group = self.groups[gi]
        plan = group.layout.buckets[bucket]
        owned = []
        for r in range(group.world_size):
            lo, hi = plan.shard_range(r)
            lo, hi = min(max(lo, start), end), max(min(hi, end), start)
            owned.append((lo - start, max(lo, hi) - start))
        return owned

    def _launch_shard_piece(self, unit: _Unit, last: bool) -> None:
        """Stage 2: exchange a finished piece of the bucket buffer; this rank's part of the
        sums goes into (or is added to) its shard accumulator."""
        gi, bucket = unit.group, unit.bucket
        group = self.groups[gi]
        plan = group.layout.buckets[bucket]
        buf = self._bucket_buffer(gi, bucket)
        written = self._bucket_written[(gi, bucket)]
        self._zero_unwritten(gi, bucket, buf, (unit.start, unit.end), unit.params, written)
        source = buf[unit.start - plan.start : unit.end - plan.start]
        wire = self._wire(source)
        owned = self._owned_in(gi, bucket, unit.start, unit.end)
        a, b = owned[group.rank]
        shard_lo = group.owned[bucket][0]
        target = group.grad[bucket][unit.start + a - shard_lo : unit.start + b - shard_lo]
        accumulate = not self._fresh[gi][bucket]
        direct = wire.dtype == target.dtype and not accumulate
        out = target if direct else torch.empty(b - a, dtype=wire.dtype, device=wire.device)
        work = collectives.reduce_scatter_ranges(wire, owned, self.process_group, async_op=True, out=out)

        def after() -> None:
            if out is not target:
                target.add_(out) if accumulate else target.copy_(out)
            if last:  # the bucket's last piece: its buffer is done for this micro step
                self._fresh[gi][bucket] = False
                self._bucket_buffers.pop((gi, bucket), None)
                self._bucket_written.pop((gi, bucket), None)

        self._inflight.append(_Inflight(work, after))

    def _launch(self, gi: int, bucket: int) -> None:
        """Reduce one whole bucket (all-reduce, or reduce-scatter into this rank's shard)."""
        group = self.groups[gi]
        plan = group.layout.buckets[bucket]
        if group.grad_buffer is not None:
            group.settle(bucket)
            source = group.grad_buffer[plan.start : plan.end]
        else:
            source = self._bucket_buffer(gi, bucket)
            self._settle_bucket_buffer(gi, bucket, source)
        wire = self._wire(source)
        target = group.grad[bucket]
        accumulate = group.grad_buffer is None and not self._fresh[gi][bucket]
        if not self.policy.shard:
            work = collectives.all_reduce(wire, op="sum", group=self.process_group, async_op=True)

            def after() -> None:
                if wire is not source:
                    source.copy_(wire)
        else:
            direct = wire.dtype == target.dtype and not accumulate
            lo, hi = group.owned[bucket]
            out = (
                (target if group.grad_buffer is None else source[lo - plan.start : hi - plan.start])
                if direct
                else torch.empty(hi - lo, dtype=wire.dtype, device=wire.device)
            )
            work = collectives.reduce_scatter_flat(
                out, wire, group=self.process_group, async_op=True, input_is_scratch=True
            )

            def after() -> None:
                if out is not target and not (group.grad_buffer is not None and direct):
                    if accumulate:
                        target.add_(out)
                    else:
                        target.copy_(out)
                self._fresh[gi][bucket] = False
                if group.grad_buffer is None:
                    self._bucket_buffers.pop((gi, bucket), None)

        self._inflight.append(_Inflight(work, after))

    # ------------------------------------------------------------------ end of backward
    def finish(self) -> None:
        """Launch every remaining bucket of this backward and wait for all reductions."""
        if self._active and self._reducing():
            while self._next_unit < len(self._units):
                self._launch_unit(self._next_unit)
                self._next_unit += 1
        for item in self._inflight:
            if item.work is not None:
                item.work.wait()
            item.after()
        self._inflight = []
        if self._active and self._reducing():
            self._reset_counts()
        if self._arrived:
            if not self._learned:  # the first backward only observed the gradient pattern
                self._learned = True
                self._early = not self._repeats_seen
            self._arrived = set()
        self._active = False

    def reduce_all_now(self) -> None:
        """Reduce every bucket even if no backward ran (all ranks must call it together)."""
        self._active = True
        saved = self.reduce_this_backward
        self.reduce_this_backward = True
        self.finish()
        self.reduce_this_backward = saved

    def new_accumulation(self) -> None:
        """Called after the optimizer step: shard accumulators start fresh."""
        self._fresh = [[True] * len(g.layout.buckets) for g in self.groups]
        self._bucket_buffers.clear()
        self._bucket_written.clear()
