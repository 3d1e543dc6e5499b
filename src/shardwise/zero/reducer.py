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

Stage 0 always overlaps, whatever ``overlap_comm`` says: its all-reduce works in place on
the flat gradient buffer, so overlapping costs no memory (DeepSpeed's ``overlap_comm:
false`` exists to save the extra buffers its overlap needs). So does stage 1 where its
reduce-scatter is an in-place all-reduce anyway (gloo on CPU, see
:func:`shardwise.comm.collectives.choose_algorithm`). Parameters sit in a bucket in
reverse registration order, the order backward produces their gradients, so the finished
part of a bucket grows from its start; whenever it has grown by ``CHUNK_NUMEL`` elements
it is all-reduced while backward goes on (the way DDP's 25 MB buckets overlap), and the
rest goes when backward ends. Each element is summed exactly as before, only sooner.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from shardwise.comm import collectives
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


# Stages 0-1: all-reduce the finished part of a bucket once it holds this many elements
# (DDP's default bucket: 25 MiB of fp32).
CHUNK_NUMEL = 25 * 2**20 // 4


@dataclass
class _Inflight:
    work: Any
    after: Callable[[], None]


def _reduce_scatter_is_all_reduce(groups: list[FlatGroup], process_group: Any) -> bool:
    """Whether this group's in-place reduce-scatter is an all-reduce of the whole buffer."""
    import torch.distributed as dist

    if not groups or not dist.is_initialized():
        return False
    backend = str(dist.get_backend(process_group))
    choice = collectives.choose_algorithm(
        "reduce_scatter", backend, groups[0].device.type, 0, input_is_scratch=True
    )
    return choice == "all_reduce"


class GradientReducer:
    """Owns the hooks and the in-flight reductions of a set of flat groups."""

    def __init__(self, groups: list[FlatGroup], policy: ReducePolicy, process_group: Any = None) -> None:
        self.groups = groups
        self.policy = policy
        self.process_group = process_group
        self.reduce_this_backward = True  # set by the engine before each backward
        self.sync_enabled = True  # False inside no_sync()
        self._pending: list[list[int]] = []
        self._launched: list[list[bool]] = []
        self._fresh: list[list[bool]] = [[True] * len(g.layout.buckets) for g in groups]
        self._bucket_buffers: dict[tuple[int, int], torch.Tensor] = {}
        self._bucket_written: dict[tuple[int, int], set[int]] = {}
        self._inflight: list[_Inflight] = []
        self._active = False
        self._expected_ptr: list[list[int]] = []
        # stage 0, progressive all-reduce: each bucket's parameters by offset, which of them
        # have their gradient in this backward, how far the ready prefix / the launches got
        self._progressive = all(g.grad_buffer is not None for g in groups) and (
            not policy.shard or _reduce_scatter_is_all_reduce(groups, process_group)
        )
        self._order = [
            [sorted(b.param_indices, key=lambda i: g.layout.slots[i].offset) for b in g.layout.buckets]
            for g in groups
        ]
        self._ready: list[list[set[int]]] = []
        self._frontier: list[list[int]] = []
        self._sent_to: list[list[int]] = []
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
    def _reset_counts(self) -> None:
        self._pending = [[len(b.param_indices) for b in g.layout.buckets] for g in self.groups]
        self._launched = [[False] * len(g.layout.buckets) for g in self.groups]
        self._ready = [[set() for _ in g.layout.buckets] for g in self.groups]
        self._frontier = [[0] * len(g.layout.buckets) for g in self.groups]
        self._sent_to = [[b.start for b in g.layout.buckets] for g in self.groups]

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
        self._accumulate(gi, pi, param)
        if not self._reducing():
            return
        bucket = self.groups[gi].layout.slots[pi].bucket
        self._pending[gi][bucket] -= 1
        if self._progressive:
            self._advance(gi, bucket, pi)
        elif self._pending[gi][bucket] == 0 and self.policy.overlap:
            self._launch(gi, bucket)

    def _advance(self, gi: int, bucket: int, pi: int) -> None:
        """All-reduce the bucket's ready prefix once it is ``CHUNK_NUMEL`` long (stages 0-1)."""
        ready, order = self._ready[gi][bucket], self._order[gi][bucket]
        ready.add(pi)
        frontier = self._frontier[gi][bucket]
        while frontier < len(order) and order[frontier] in ready:
            frontier += 1
        self._frontier[gi][bucket] = frontier
        group = self.groups[gi]
        plan = group.layout.buckets[bucket]
        end = plan.end if frontier == len(order) else group.param_view(order[frontier])[0]
        if end - self._sent_to[gi][bucket] >= min(CHUNK_NUMEL, plan.numel) or end == plan.end:
            self._launch_range(gi, bucket, self._sent_to[gi][bucket], end)
            self._sent_to[gi][bucket] = end
            if end == plan.end:
                self._launched[gi][bucket] = True

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
        group = self.groups[gi]
        plan = group.layout.buckets[bucket]
        written = self._bucket_written.pop((gi, bucket), set())
        position = plan.start
        for pi in plan.param_indices:
            lo, hi = group.param_view(pi)
            if lo > position:
                buf[position - plan.start : lo - plan.start].zero_()
            if pi not in written:
                buf[lo - plan.start : hi - plan.start].zero_()
            position = hi
        if position < plan.end:
            buf[position - plan.start :].zero_()

    def _launch_range(self, gi: int, bucket: int, start: int, end: int) -> None:
        """All-reduce ``grad_buffer[start:end]`` (a finished part of a bucket) in place; at
        stage 1 this rank then reads its shard of the sums from the same buffer."""
        if end <= start:
            return
        group = self.groups[gi]
        assert group.grad_buffer is not None
        source = group.grad_buffer[start:end]
        policy = self.policy
        wire = source if policy.comm_dtype in (None, source.dtype) else source.to(policy.comm_dtype)
        if policy.pre_multiplier != 1.0:
            wire.mul_(policy.pre_multiplier)
        work = collectives.all_reduce(wire, op="sum", group=self.process_group, async_op=True)

        def after() -> None:
            if wire is not source:
                source.copy_(wire)

        self._inflight.append(_Inflight(work, after))

    def _launch(self, gi: int, bucket: int) -> None:
        if self._launched[gi][bucket]:
            return
        self._launched[gi][bucket] = True
        group = self.groups[gi]
        plan = group.layout.buckets[bucket]
        if self._progressive:
            group.settle(bucket)  # slots no gradient reached (all beyond the ready prefix)
            self._launch_range(gi, bucket, self._sent_to[gi][bucket], plan.end)
            self._sent_to[gi][bucket] = plan.end
            return
        if group.grad_buffer is not None:
            group.settle(bucket)
            source = group.grad_buffer[plan.start : plan.end]
        else:
            source = self._bucket_buffer(gi, bucket)
            self._settle_bucket_buffer(gi, bucket, source)
        policy = self.policy
        wire = source if policy.comm_dtype in (None, source.dtype) else source.to(policy.comm_dtype)
        if policy.pre_multiplier != 1.0:
            wire.mul_(policy.pre_multiplier)
        target = group.grad[bucket]
        accumulate = group.grad_buffer is None and not self._fresh[gi][bucket]
        if not policy.shard:
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
            for gi, group in enumerate(self.groups):
                for bucket in range(len(group.layout.buckets)):
                    self._launch(gi, bucket)
        for item in self._inflight:
            if item.work is not None:
                item.work.wait()
            item.after()
        self._inflight = []
        if self._active and self._reducing():
            self._reset_counts()
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
