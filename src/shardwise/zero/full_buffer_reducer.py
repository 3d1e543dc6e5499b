"""Stages 0-1: gradients accumulate in each group's full gradient buffer and are reduced there.

Stage 0 all-reduces the buffer; stage 1 reduce-scatters it, then reads its shard of it
(``FlatGroup.grad`` are views of the buffer at this rank's shards). With matching dtypes
autograd accumulates straight into the buffer (``param.grad`` is a view of its slot), so
a gradient costs no copy. Reduction happens at the accumulation boundary only.

Progressive (see :mod:`shardwise.zero.launch_order`): always at stage 0 (pieces are
all-reduced in place); at stage 1 where the reduce-scatter is an exchange between the
shard owners (each rank receives the sums of its part of a piece) or an in-place
all-reduce. Otherwise (stage 1 with a native reduce-scatter) whole buckets go, in sequence.
"""

from __future__ import annotations

import torch

from shardwise.comm import collectives
from shardwise.comm.group_type import Group
from shardwise.zero.flat_group import FlatGroup
from shardwise.zero.reducer import GradientReducer, ReducePolicy


class FullBufferReducer(GradientReducer):
    """Reduces the full gradient buffers of stages 0-1 in place (all-reduce, exchange or
    reduce-scatter), bucket by bucket or piece by piece."""

    def __init__(self, groups: list[FlatGroup], policy: ReducePolicy, process_group: Group = None) -> None:
        assert all(g.grad_buffer is not None for g in groups), "stages 0-1 keep a full gradient buffer"
        # Every group's gradient buffer reduced by collectives that are done when they return
        # (the transport reads the other ranks' buffers; the wire is the buffer itself): whole
        # buckets, once backward has filled them. Nothing is gained by going piece by piece then:
        # the reduction costs a summing pass, not a transfer to overlap, and each piece would
        # pay two barriers.
        self.whole_buckets = policy.local or all(
            g.grad_store is not None
            and g.grad_store.synchronous
            and policy.comm_dtype in (None, g.grad_dtype)
            for g in groups
        )
        super().__init__(groups, policy, process_group)
        # Where autograd accumulates a parameter's gradient once .grad is a view of its slot.
        self._expected_ptr = [
            [
                group.grad_buffer[group.param_view(i)[0] :].data_ptr() if group.grads_are_views else 0  # type: ignore[index]
                for i in range(len(group.params))
            ]
            for group in groups
        ]

    def _reduces_in_pieces(self, algorithm: str) -> bool:
        return not self.whole_buckets and (self._piece_exchange or algorithm == "all_reduce")

    def _accumulate(self, gi: int, pi: int, param: torch.Tensor) -> None:
        group = self.groups[gi]
        grad = param.grad
        if grad is None:
            return
        if group.grads_are_views and grad.data_ptr() == self._expected_ptr[gi][pi]:
            return  # accumulated in place by autograd
        # the window's first gradient (autograd handed over a fresh tensor), a 16-bit
        # gradient for a wider buffer, or a .grad someone replaced: fold it in
        group.fold_grad(pi, grad)

    def _launch_unit(self, k: int) -> None:
        unit = self._unit(k)
        if self.groups[unit.group].world_size == 1:
            # One data-parallel rank (e.g. a pipeline stage with no replica): its gradients are the
            # sums. The layout's group of one rank is None, which a collective would take as the world.
            self.groups[unit.group].settle(unit.bucket)
            return
        if not self.in_pieces:
            self._launch_bucket(unit.group, unit.bucket)
            return
        if self.order.missing(k):
            self.groups[unit.group].settle(unit.bucket)  # slots no gradient reached in this window
        self._launch_range(unit.group, unit.bucket, unit.start, unit.end)

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
        work: object
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

        self._in_flight(work, after)

    def _launch_bucket(self, gi: int, bucket: int) -> None:
        """Stage 1 (stage 0 goes in pieces unless ``whole_buckets``): reduce one whole bucket of the buffer
        in place, so this rank's shard of it holds its sums (the whole bucket where every rank
        gets them: stage 0, ``reduce_scatter: false``)."""
        group = self.groups[gi]
        assert group.grad_store is not None and (self.whole_buckets or self.policy.shard)
        plan = group.layout.buckets[bucket]
        group.settle(bucket)
        source = group.grad_store.mine[plan.start : plan.end]
        wire = self._wire(source)
        everyone = self.policy.all_reduce_gradients or not self.policy.shard
        self._reduce_bucket(
            gi,
            bucket,
            group.grad_store,
            0,
            wire,
            # this rank's shard of the buffer; the bucket itself when every rank gets the sums and
            # they travel in another dtype (whole buckets: one rank alone, ``policy.local``)
            (None if wire is source else source) if everyone else group.grad[bucket],
            accumulate=False,
            done=_nothing,
        )


def _nothing() -> None:
    """Nothing to do once a full buffer's bucket is reduced: the sums are in the buffer."""
