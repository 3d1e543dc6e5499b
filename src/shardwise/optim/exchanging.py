"""The seam between an optimizer that communicates by itself and the ZeRO stage that runs it.

1-bit optimizers (:class:`~shardwise.optim.onebit_adam.OneBitAdam`) replace the gradient
all-reduce, after a warm-up, by a compressed exchange of their momentum inside ``step()``.
They declare it through :class:`GradientExchangingOptimizer`; the stage-0 strategy
(:class:`shardwise.zero.sharded_optimizer.ZeroOptimizer`) then

- hands the optimizer its data-parallel group once (:meth:`attach_process_group`);
- before every backward, asks :attr:`exchanges_gradients`: when True, gradients stay local
  (the reducer launches no all-reduce), and the step unscales/clips the local gradients;
- saves :meth:`rank_state_dict` per rank in checkpoints (error buffers differ per rank); when
  :meth:`load_rank_state_dict` returns True it rewrote parameter values, which are re-published;
- optionally reads ``communicates_next_step`` (a bool property): False for a step that sends
  nothing at all (0/1 Adam's local steps); then, unless an overflow check (fp16) needs the
  ranks to agree, the gradient norm (and clipping) is this rank's own and no collective is made.

Example:
    >>> import torch
    >>> isinstance(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1), GradientExchangingOptimizer)
    False
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from shardwise.comm.group_type import Group

__all__ = ["GradientExchangingOptimizer"]


@runtime_checkable
class GradientExchangingOptimizer(Protocol):
    """An optimizer that, in some phases, averages its state across ranks itself."""

    @property
    def exchanges_gradients(self) -> bool:
        """The next ``step()`` exchanges by itself: gradients must reach it un-reduced (local)."""
        ...

    def attach_process_group(self, group: Group) -> None:
        """The data-parallel group to exchange over (None: the world); called once, before training."""
        ...

    def rank_state_dict(self) -> dict[str, Any]:
        """This rank's own state (error buffers), saved per rank."""
        ...

    def load_rank_state_dict(self, state: Mapping[str, object] | None) -> bool | None:
        """Restore :meth:`rank_state_dict` (None: no saved state for this rank; start afresh).

        Returns True when it rewrote the parameters' values (they are then re-published)."""
        ...
