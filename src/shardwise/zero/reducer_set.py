"""The gradient reducers of stages 0-2, one per reduction domain, driven as one.

Each :class:`~shardwise.zero.reduction_domain.ReductionDomain` (the data-parallel group for dense
parameters, the expert-data-parallel group for expert parameters) gets its own
:class:`~shardwise.zero.reducer.GradientReducer` over its flat groups, with its own launch order
and collectives. The optimizer talks to this set as to one reducer; flat-group indices here are the
optimizer's (global) ones.
"""

from __future__ import annotations

from collections.abc import Sequence

from shardwise.zero.reducer import GradientReducer


class ReducerSet:
    """Reducers with the global flat-group index of each of their groups."""

    def __init__(self, members: Sequence[tuple[GradientReducer, Sequence[int]]]) -> None:
        self.members = [(reducer, list(indices)) for reducer, indices in members]

    def _each(self, attribute: str, value: bool) -> None:
        for reducer, _ in self.members:
            setattr(reducer, attribute, value)

    @property
    def reduce_this_backward(self) -> bool:
        """Whether this backward ends an accumulation window (set before each backward)."""
        return all(r.reduce_this_backward for r, _ in self.members)

    @reduce_this_backward.setter
    def reduce_this_backward(self, value: bool) -> None:
        self._each("reduce_this_backward", value)

    @property
    def sync_enabled(self) -> bool:
        """False inside ``no_sync()``."""
        return all(r.sync_enabled for r, _ in self.members)

    @sync_enabled.setter
    def sync_enabled(self, value: bool) -> None:
        self._each("sync_enabled", value)

    @property
    def optimizer_exchanges(self) -> bool:
        """The optimizer averages by itself (1-bit optimizers): no reduction."""
        return any(r.optimizer_exchanges for r, _ in self.members)

    @optimizer_exchanges.setter
    def optimizer_exchanges(self, value: bool) -> None:
        self._each("optimizer_exchanges", value)

    @property
    def gradients_ready(self) -> bool:
        """Every group's ``grad`` holds reduced sums (until the window ends)."""
        return all(r.gradients_ready for r, _ in self.members)

    @property
    def arrived(self) -> set[tuple[int, int]]:
        """``(global group, parameter)`` pairs that got a gradient this window."""
        return {(indices[gi], pi) for reducer, indices in self.members for gi, pi in reducer.arrived}

    def finish(self) -> None:
        """Launch every remaining unit and wait, domain after domain (the same order on every rank)."""
        for reducer, _ in self.members:
            reducer.finish()

    def new_window(self) -> None:
        """A new accumulation window: accumulators reset, arrivals and readiness forgotten."""
        for reducer, _ in self.members:
            reducer.new_accumulation()
            reducer.arrived.clear()
            reducer.gradients_ready = False

    def fold_window(self) -> None:
        """Every domain brings autograd's stray gradients into its buffers (``GradientReducer.fold_window``)."""
        for reducer, _ in self.members:
            reducer.fold_window()

    def reduce_window(self) -> None:
        """Reduce the window now in every domain, domain after domain (the same order on every rank):
        a pipeline's ReduceGrads (``GradientReducer.reduce_window``)."""
        for reducer, _ in self.members:
            reducer.reduce_window()

    def remove_hooks(self) -> None:
        """Detach every reducer's hooks."""
        for reducer, _ in self.members:
            reducer.remove_hooks()
