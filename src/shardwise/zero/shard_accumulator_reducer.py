"""Stage 2: each micro step's gradients are reduce-scattered into this rank's shard accumulators.

No full gradient buffer is kept (the memory saving of stage 2). During a backward each
bucket gets a buffer of its own, uninitialised: a parameter's first gradient is copied
into its slot, later ones (a weight used twice) are added, and what no gradient wrote is
zeroed only when the bucket (or a piece of it) is launched. The reduce-scatter writes this
rank's sums into its shard accumulator (``FlatGroup.grad``) on the window's first micro
step and adds them on later ones; the bucket buffer is dropped once its last reduction is
done.

Progressive (see :mod:`shardwise.zero.launch_order`) where the reduce-scatter is an exchange
between the shard owners: a piece may cut across shards and each rank receives the sums of
its own part of it. Otherwise whole buckets go, in sequence.

Each bucket's buffer is the flat group's staging buffer for it (``FlatGroup.staging``, from its
transport): reserved at the bucket's first gradient of a micro step and released once the bucket
is reduced, so between steps stage 2 holds no full-size gradient buffer. When every group's
staging buffers reduce by collectives that are done when they return (one host's ranks reading
each other's buffers), whole buckets go at the end of backward, each rank summing its shard
straight into (or onto) its shard accumulator.
"""

from __future__ import annotations

import torch

from shardwise.comm import collectives
from shardwise.comm.group_type import Group
from shardwise.zero.flat_group import FlatGroup
from shardwise.zero.launch_order import Unit
from shardwise.zero.reducer import GradientReducer, ReducePolicy


class ShardAccumulatorReducer(GradientReducer):
    """Reduces stage 2's per-micro-step bucket buffers into the shard accumulators."""

    def __init__(self, groups: list[FlatGroup], policy: ReducePolicy, process_group: Group = None) -> None:
        assert all(g.grad_buffer is None for g in groups), "stage 2 keeps no full gradient buffer"
        self._fresh = [[True] * len(g.layout.buckets) for g in groups]  # per bucket: no sums yet this window
        self._bucket_buffers: dict[tuple[int, int], torch.Tensor] = {}
        self._bucket_written: dict[tuple[int, int], set[int]] = {}  # parameters written per bucket buffer
        self.whole_buckets = policy.local or all(
            s.synchronous and policy.comm_dtype in (None, g.grad_dtype) for g in groups for s in g.staging
        )
        super().__init__(groups, policy, process_group)

    def _reduces_in_pieces(self, algorithm: str) -> bool:
        return self._piece_exchange and not self.whole_buckets

    def new_accumulation(self) -> None:
        """Called after the optimizer step: shard accumulators start fresh."""
        self._fresh = [[True] * len(g.layout.buckets) for g in self.groups]
        for group in self.groups:
            for store in group.staging:
                store.release()
        self._bucket_buffers.clear()
        self._bucket_written.clear()

    # ------------------------------------------------------------------ bucket buffers
    def _accumulate(self, gi: int, pi: int, param: torch.Tensor) -> None:
        group = self.groups[gi]
        grad = param.grad
        if grad is None:
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

    def _bucket_buffer(self, gi: int, bucket: int) -> torch.Tensor:
        """This micro step's gradient buffer of a bucket: uninitialised; each parameter's
        slot is written by its first gradient, the rest zeroed at launch."""
        key = (gi, bucket)
        buf = self._bucket_buffers.get(key)
        if buf is None:
            store = self.groups[gi].staging[bucket]
            store.reserve()
            buf = store.mine
            self._bucket_buffers[key] = buf
            self._bucket_written[key] = set()
        return buf

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

    # ------------------------------------------------------------------ launches
    def _launch_unit(self, k: int) -> None:
        unit = self._unit(k)
        if self.in_pieces:
            self._launch_piece(unit, last=self.order.ends_bucket(k))
        else:
            self._launch_bucket(unit.group, unit.bucket)

    def _launch_piece(self, unit: Unit, last: bool) -> None:
        """Exchange a finished piece of the bucket buffer; this rank's part of the sums goes
        into (or is added to) its shard accumulator."""
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
                group.staging[bucket].release()

        self._in_flight(work, after)

    def _launch_bucket(self, gi: int, bucket: int) -> None:
        """Reduce one whole bucket buffer into (or onto) this rank's shard accumulator; the bucket's
        staging buffer is given back once every rank has summed from it."""
        group = self.groups[gi]
        plan = group.layout.buckets[bucket]
        source = self._bucket_buffer(gi, bucket)
        written = self._bucket_written.pop((gi, bucket), set())
        self._zero_unwritten(gi, bucket, source, (plan.start, plan.end), plan.param_indices, written)
        store = group.staging[bucket]

        def done() -> None:
            self._fresh[gi][bucket] = False
            self._bucket_buffers.pop((gi, bucket), None)
            store.release()  # every rank has summed from it (the collective is complete)

        self._reduce_bucket(
            gi,
            bucket,
            store,
            plan.start,
            self._wire(source),
            group.grad[bucket],
            accumulate=not self._fresh[gi][bucket],
            done=done,
        )
