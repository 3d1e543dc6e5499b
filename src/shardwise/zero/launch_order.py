"""The order in which gradient reductions are launched during backward (pure: no torch, no process group).

Every rank must issue the same collectives in the same order, whatever order its hooks fire
in (a rank may skip a parameter another rank uses). So the reductions of a set of flat
groups form one fixed sequence of *units*, and a unit is launched only after every unit
before it, as DDP does:

- a unit is a whole bucket, or, when reduction is progressive, a piece of a bucket of about
  ``CHUNK_NUMEL`` elements cut at parameter boundaries (the way DDP's 25 MB buckets
  overlap). Parameters sit in a bucket in reverse registration order, the order backward
  produces their gradients, so the first pieces complete first;
- a unit is complete when every parameter in it has its gradient for this backward;
  complete units at the head of the sequence may be launched while backward runs, the
  rest go when backward ends, in sequence (unit by unit, whatever is missing).

Launching early is learned: the first backward only observes, and a model in which a
parameter receives two gradients in one backward (reentrant activation checkpointing of a
shared weight) keeps reducing after backward, because the second gradient would land in a
unit already on the wire. A second gradient for a unit already launched is an error.

:class:`LaunchOrder` keeps this bookkeeping; the reducer (:mod:`shardwise.zero.reducer`)
feeds it the hooks' arrivals and launches the units it hands back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from shardwise.utils.logging import logger
from shardwise.zero.partition import FlatLayout

# Progressive reduction: reduce the finished part of a bucket once it holds this many
# elements (DDP's default bucket: 25 MiB of fp32). Stages 0-2, wherever reduction is
# progressive (see shardwise.zero.reducer).
CHUNK_NUMEL = 25 * 2**20 // 4


@dataclass(frozen=True)
class Unit:
    """One reduction of the fixed launch sequence: ``[start, end)`` (flat-buffer coordinates)
    of bucket ``bucket`` of group ``group``, complete when every parameter in ``params`` (in
    offset order) has its gradient."""

    group: int
    bucket: int
    start: int
    end: int
    params: tuple[int, ...]


def plan_units(layouts: Sequence[FlatLayout], *, pieces: bool, chunk_numel: int | None = None) -> list[Unit]:
    """The fixed launch sequence: every bucket of every group in order, cut into pieces of
    about ``chunk_numel`` elements (default :data:`CHUNK_NUMEL`) at parameter boundaries when
    ``pieces``. A piece ends after the parameter that brings it to ``chunk_numel`` elements;
    the bucket's last piece runs to the bucket's end (its padding included).

    Example:
        >>> from shardwise.zero.partition import plan_layout
        >>> layout = plan_layout([4, 4, 4], world_size=1, bucket_numel=100)
        >>> [(u.start, u.end, u.params) for u in plan_units([layout], pieces=True, chunk_numel=8)]
        [(0, 8, (2, 1)), (8, 12, (0,))]
    """
    chunk = CHUNK_NUMEL if chunk_numel is None else chunk_numel
    units: list[Unit] = []
    for gi, layout in enumerate(layouts):
        for b, plan in enumerate(layout.buckets):
            order = sorted(plan.param_indices, key=lambda i: layout.slots[i].offset)
            if not pieces:
                units.append(Unit(gi, b, plan.start, plan.end, tuple(order)))
                continue
            start, members = plan.start, []
            for pi in order:
                members.append(pi)
                slot = layout.slots[pi]
                end = slot.offset + slot.numel
                if end - start >= chunk and pi != order[-1]:
                    units.append(Unit(gi, b, start, end, tuple(members)))
                    start, members = end, []
            units.append(Unit(gi, b, start, plan.end, tuple(members)))
    return units


def _default_label(group: int, param: int) -> str:
    return f"parameter {param} of group {group}"


class LaunchOrder:
    """Which units of a fixed sequence may be launched, given the gradients that arrived.

    The reducer calls :meth:`arrive` from each gradient hook and launches the units it
    returns; when backward ends it launches :meth:`take_remaining` and, once they are done,
    calls :meth:`end_backward`. ``reducing`` says whether this backward's gradients are
    reduced at all (not inside ``no_sync``, and at stages 0-1 only at the accumulation
    boundary); arrivals are recorded either way (for repeats and learning).

    Args:
        units: the sequence (see :func:`plan_units`).
        launch_while_backward: whether units may go before backward ends at all (reduction
            in pieces, or ``overlap_comm``); it still waits for the first backward to learn.
        label: names a parameter in the repeated-gradient error (``label(group, param)``).

    Example:
        >>> order = LaunchOrder([Unit(0, 0, 0, 4, (1,)), Unit(0, 0, 4, 8, (0,))], launch_while_backward=True)
        >>> order.arrive(0, 1, reducing=True)  # the first backward only observes
        []
        >>> order.take_remaining()
        [0, 1]
        >>> order.end_backward(reducing=True)
        >>> order.arrive(0, 0, reducing=True), order.arrive(0, 1, reducing=True)
        ([], [0, 1])
    """

    def __init__(
        self,
        units: Sequence[Unit],
        *,
        launch_while_backward: bool,
        label: Callable[[int, int], str] = _default_label,
    ) -> None:
        self.units: tuple[Unit, ...] = tuple(units)
        self.launch_while_backward = launch_while_backward
        self._label = label
        self._unit_of = {(u.group, pi): k for k, u in enumerate(self.units) for pi in u.params}
        self._bucket_ends = {  # units that end a bucket
            k
            for k, u in enumerate(self.units)
            if k + 1 == len(self.units)
            or (self.units[k + 1].group, self.units[k + 1].bucket) != (u.group, u.bucket)
        }
        self.early = False  # may units launch before backward ends? (learned after the first backward)
        self.learned = False
        self.repeats_seen = False
        self._arrived: set[tuple[int, int]] = set()  # this backward's (group, param) gradients
        self._missing: list[int] = []
        self.next_unit = 0  # the first unit not launched yet
        self._reset_counts()

    def _reset_counts(self) -> None:
        self._missing = [len(u.params) for u in self.units]
        self.next_unit = 0

    # ------------------------------------------------------------------ queries
    @property
    def backward_seen(self) -> bool:
        """Whether a gradient arrived since the last :meth:`end_backward`."""
        return bool(self._arrived)

    def unit_of(self, group: int, param: int) -> int:
        """The index of the unit holding parameter ``param`` of group ``group``."""
        return self._unit_of[(group, param)]

    def missing(self, k: int) -> int:
        """How many parameters of unit ``k`` have no gradient yet in this backward."""
        return self._missing[k]

    def ends_bucket(self, k: int) -> bool:
        """Whether unit ``k`` is its bucket's last."""
        return k in self._bucket_ends

    # ------------------------------------------------------------------ events
    def arrive(self, group: int, param: int, *, reducing: bool) -> list[int]:
        """Record a gradient for ``param`` of ``group``; return the units to launch now, in order.

        A second gradient in one backward turns early launching off for good (with a
        warning if it was on); if its unit is already launched it raises ``RuntimeError``.
        """
        repeat = (group, param) in self._arrived
        self._arrived.add((group, param))
        if repeat:
            self._on_repeat(group, param, reducing)
            return []
        if not reducing:
            return []
        self._missing[self._unit_of[(group, param)]] -= 1
        if self.early and self.launch_while_backward:
            return self._take_ready()
        return []

    def _on_repeat(self, group: int, param: int, reducing: bool) -> None:
        """A parameter got a second gradient in this backward (autograd just added it)."""
        if reducing and self._unit_of[(group, param)] < self.next_unit:
            raise RuntimeError(
                f"{self._label(group, param)} received a second "
                "gradient in one backward after its gradients were already being reduced. This happens with "
                "reentrant activation checkpointing (torch.utils.checkpoint(use_reentrant=True)) of a weight "
                "used in several checkpointed segments, when that only happens in some steps. Use "
                "use_reentrant=False, or call backward once per micro step."
            )
        if self.early:
            logger.warning(
                "a parameter receives more than one gradient per backward (reentrant activation checkpointing "
                "of a shared weight?): gradients are now reduced after backward instead of during it"
            )
        self.repeats_seen = True
        self.early = False

    def _take_ready(self) -> list[int]:
        """Complete units at the head of the sequence (never one before an earlier one)."""
        ready = []
        while self.next_unit < len(self.units) and self._missing[self.next_unit] == 0:
            ready.append(self.next_unit)
            self.next_unit += 1
        return ready

    def take_remaining(self) -> list[int]:
        """When a reduced backward ends: every unit not launched yet, in order (none if no
        gradient arrived), all counted as launched."""
        if not self._arrived:
            return []
        rest = list(range(self.next_unit, len(self.units)))
        self.next_unit = len(self.units)
        return rest

    def end_backward(self, *, reducing: bool) -> None:
        """After this backward's reductions are done: reset the arrival counts (if it was
        reduced) and, after the first backward with gradients, decide on early launching."""
        if self._arrived and reducing:
            self._reset_counts()
        if self._arrived:
            if not self.learned:  # the first backward only observed the gradient pattern
                self.learned = True
                self.early = not self.repeats_seen
            self._arrived = set()
