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
a bucket is cut into pieces at parameter boundaries and each piece is reduced as soon as
its gradients are in. Stage 0 all-reduces the pieces in place in its flat gradient
buffer. Stages 1 and 2 do so where the reduce-scatter is an exchange between the shard
owners (gloo groups of two ranks, see :func:`shardwise.comm.collectives.choose_algorithm`
and :mod:`shardwise.comm.exchange`): a piece may cut across shards, and each rank receives
the sums of its own part of it (stage 2 adds them to its shard accumulator). Stage 1 also
goes progressive where its reduce-scatter is an in-place all-reduce.

Which piece (or whole bucket) goes when, identically on every rank, is decided by
:mod:`shardwise.zero.launch_order`. This module holds what the two gradient layouts
share: the hooks, the launch-order bookkeeping, the in-flight reductions and the wire
tensor. The layouts are :class:`~shardwise.zero.full_buffer_reducer.FullBufferReducer`
(stages 0-1: one full gradient buffer) and
:class:`~shardwise.zero.shard_accumulator_reducer.ShardAccumulatorReducer` (stage 2:
per-micro-step bucket buffers reduce-scattered into shard accumulators).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from shardwise.comm import collectives
from shardwise.comm import init as comm_init
from shardwise.comm.flat_buffers import FlatBuffer, land
from shardwise.comm.group_type import Group
from shardwise.zero.flat_group import FlatGroup
from shardwise.zero.launch_order import LaunchOrder, Unit, plan_units


@dataclass(frozen=True)
class ReducePolicy:
    """How gradients travel: derived once from the config.

    Attributes:
        shard: reduce-scatter (stages 1-2) instead of all-reduce (stage 0).
        every_micro_step: reduce on every backward (stage 2) rather than at the boundary.
        overlap: launch a bucket as soon as it is complete (``overlap_comm``).
        comm_dtype: dtype on the wire (``communication_data_type``), None = gradient dtype.
        pre_multiplier: applied before the reduction (prescale 1/W or predivide 1/f), 1.0 = none.
        all_reduce_gradients: stages 1-2 with ``reduce_scatter: false``: all-reduce each bucket
            (or piece), then keep this rank's shard of the sums.
        local: the parameters are replicated on this rank only (expert parameters whose
            expert-data-parallel group has one rank): nothing to reduce, no collective; whole
            buckets land in place (pre-multiplied like the others).
    """

    shard: bool
    every_micro_step: bool
    overlap: bool
    comm_dtype: torch.dtype | None
    pre_multiplier: float
    all_reduce_gradients: bool = False
    local: bool = False


@dataclass
class _Inflight:
    work: Any
    after: Callable[[], None]


def _reduce_scatter_algorithm(groups: list[FlatGroup], process_group: Group) -> str:
    """How this group's in-place reduce-scatter runs (see ``collectives.choose_algorithm``)."""
    if not groups or not comm_init.is_initialized():
        return "native"
    return collectives.choose_algorithm(
        "reduce_scatter",
        comm_init.get_backend(process_group),
        groups[0].device.type,
        0,
        input_is_scratch=True,
        world_size=comm_init.get_world_size(process_group),
    )


class GradientReducer(ABC):
    """Owns the hooks and the in-flight reductions of a set of flat groups.

    A subclass per gradient layout says how a gradient is stored (``_accumulate``), how one
    unit of the launch order is reduced (``_launch_unit``), whether units are pieces of
    buckets (``_reduces_in_pieces``) and what a new accumulation window resets
    (``new_accumulation``).
    """

    def __init__(self, groups: list[FlatGroup], policy: ReducePolicy, process_group: Group = None) -> None:
        self.groups = groups
        self.policy = policy
        self.process_group = process_group
        self.reduce_this_backward = True  # set by the engine before each backward
        self.sync_enabled = True  # False inside no_sync()
        self.optimizer_exchanges = False  # the optimizer averages by itself (1-bit): no reduction
        self._inflight: list[_Inflight] = []
        self.arrived: set[tuple[int, int]] = set()  # (group, parameter) that got a gradient this window
        self.gradients_ready = False  # the groups' ``grad`` hold reduced sums (until the window ends)
        forced = policy.all_reduce_gradients or not policy.shard
        algorithm = "all_reduce" if forced else _reduce_scatter_algorithm(groups, process_group)
        self._piece_exchange = policy.shard and algorithm == "exchange" and not policy.local
        self.in_pieces = not policy.local and self._reduces_in_pieces(algorithm)
        self.order = LaunchOrder(
            plan_units([g.layout for g in groups], pieces=self.in_pieces),
            launch_while_backward=self.in_pieces or policy.overlap,
            label=self._label,
        )
        self._handles = [
            param.register_post_accumulate_grad_hook(self._make_hook(gi, pi))
            for gi, group in enumerate(groups)
            for pi, param in enumerate(group.params)
        ]

    # ------------------------------------------------------------------ per layout
    @abstractmethod
    def _reduces_in_pieces(self, algorithm: str) -> bool:
        """Whether buckets are reduced in pieces while backward runs, given the in-place
        reduce-scatter ``algorithm`` ("all_reduce" at stage 0)."""

    @abstractmethod
    def _accumulate(self, gi: int, pi: int, param: torch.Tensor) -> None:
        """Move ``param.grad`` into this layout's buffers (unless autograd already did)."""

    @abstractmethod
    def _launch_unit(self, k: int) -> None:
        """Launch the reduction of unit ``k`` of the launch order."""

    def new_accumulation(self) -> None:
        """Called after the optimizer step (and when gradients are zeroed)."""
        return  # nothing to reset by default (stage 2 overrides it)

    # ------------------------------------------------------------------ hooks
    def _label(self, gi: int, pi: int) -> str:
        return f"parameter {pi} of group {gi} (shape {tuple(self.groups[gi].params[pi].shape)})"

    def _reducing(self) -> bool:
        if self.optimizer_exchanges:
            return False
        return self.sync_enabled and (self.policy.every_micro_step or self.reduce_this_backward)

    def _make_hook(self, gi: int, pi: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            self._on_grad(gi, pi, param)

        return hook

    def _on_grad(self, gi: int, pi: int, param: torch.Tensor) -> None:
        if getattr(param, "ds_grad_is_ready", True) is False:
            return  # a tiled compute (sequence/tiled.py) adds more of this backward's gradient before it is done
        self.arrived.add((gi, pi))
        self._accumulate(gi, pi, param)
        for k in self.order.arrive(gi, pi, reducing=self._reducing()):
            self._launch_unit(k)

    def fold_window(self) -> None:
        """Bring every gradient autograd left outside this layout's buffers into them, as the hooks
        do (a ``.grad`` assigned rather than accumulated, e.g. by a zero-bubble pipeline's weight pass)."""
        for gi, group in enumerate(self.groups):
            for pi, param in enumerate(group.params):
                self._accumulate(gi, pi, param)

    def reduce_window(self) -> None:
        """Reduce the window now, as a boundary backward would: every parameter counts as arrived
        (its gradient folded in first) and the units launch in the usual order, then :meth:`finish`.
        For a pipeline, whose micro batches' backwards ran without reducing and whose tied
        gradients were summed over stages in between."""
        self.reduce_this_backward = True
        for gi, group in enumerate(self.groups):
            for pi, param in enumerate(group.params):
                self._on_grad(gi, pi, param)
        self.finish()

    def remove_hooks(self) -> None:
        """Detach every hook (when the optimizer is closed: ``engine.destroy()``)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # ------------------------------------------------------------------ shared by the layouts
    def _unit(self, k: int) -> Unit:
        return self.order.units[k]

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

    def _reduce_bucket(
        self,
        gi: int,
        bucket: int,
        store: FlatBuffer,
        base: int,
        wire: torch.Tensor,
        target: torch.Tensor | None,
        *,
        accumulate: bool,
        done: Callable[[], None],
    ) -> None:
        """The one launch path of a whole bucket, whichever transport carries it.

        ``store`` is the buffer the bucket lies in, whose transport carries the reduction, its
        element 0 at flat position ``base`` (0 for a whole group's buffer, the bucket's start for
        a bucket's own buffer); ``wire`` is the bucket as it goes on the wire (pre-multiplied). Stage 0 and
        ``reduce_scatter: false`` all-reduce it, the others reduce-scatter it; this rank's shard
        of the sums then lands in ``target`` (added to it with ``accumulate``), or stays in
        ``wire`` when ``target`` is None. ``done`` runs once the sums are in place.
        """
        group = self.groups[gi]
        plan = group.layout.buckets[bucket]
        if self.policy.local:  # one rank: the sums are this rank's gradients
            land(wire, target, accumulate)
            done()
            return
        ranges = [(lo - base, hi - base) for lo, hi in map(plan.shard_range, range(group.world_size))]
        everyone = self.policy.all_reduce_gradients or not self.policy.shard
        work, then = store.reduce(wire, ranges, target, accumulate=accumulate, everyone=everyone)

        def after() -> None:
            then()
            done()

        self._in_flight(work, after)

    def _in_flight(self, work: object, after: Callable[[], None]) -> None:
        """Remember a launched reduction; ``after`` runs once it is done (in ``finish``)."""
        self._inflight.append(_Inflight(work, after))

    # ------------------------------------------------------------------ end of backward
    def finish(self) -> None:
        """Launch every remaining bucket of this backward and wait for all reductions."""
        reducing = self._reducing()
        if reducing:
            for k in self.order.take_remaining():
                self._launch_unit(k)
        for item in self._inflight:
            if item.work is not None:
                item.work.wait()
            item.after()
        self._inflight = []
        self.order.end_backward(reducing=reducing)
        self.gradients_ready = self.gradients_ready or reducing
