"""Stage 3 on CPU: FSDP2's reduce-scatter issued asynchronously during backward, waited when it ends.

:class:`~shardwise.zero.stage3.Stage3Optimizer` installs it on every FSDP2 module when gradients
are reduced in fp32 on CPU (see that module's docstring for the measurement).
"""

from __future__ import annotations

from typing import Any

import torch

from shardwise.comm import collectives
from shardwise.comm.group_type import Group
from shardwise.comm.quantized_collectives import FsdpHook


class DeferredReduceScatter(FsdpHook):
    """FSDP2's reduce-scatter, issued asynchronously while armed (CPU/gloo only).

    Without streams, FSDP2 runs each unit's reduce-scatter synchronously inside backward,
    so communication never overlaps the remaining backward compute. Armed for one
    backward, this issues it asynchronously and keeps the buffers alive until
    :meth:`wait_all` (called when backward ends). That is only valid while FSDP2 does not
    read the output right away, which holds when the reduction is in fp32 (no cast after
    it) and the parameter has no gradient yet (no ``+=`` into it): the optimizer moves
    every gradient out of ``param.grad`` into its own accumulator after each backward.

    The reduction goes through :func:`shardwise.comm.collectives.reduce_scatter_flat` (the measured
    algorithm: on gloo with two ranks a point-to-point exchange); FSDP2 does not read the input after it.
    """

    def __init__(self) -> None:
        self.armed = False
        self._pending: list[tuple[Any, torch.Tensor, torch.Tensor]] = []

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: Group,
        op: object,
        async_op: bool = False,
    ) -> object:
        # shard_model forces SUM with a divide factor of 1
        op_name = self.reduce_op_name(op, "stage 3 reduce-scatter hook")
        work: Any = collectives.reduce_scatter_flat(
            output_tensor, input_tensor, group, True, op=op_name, input_is_scratch=True
        )
        if self.armed:
            self._pending.append((work, input_tensor, output_tensor))
        else:
            work.wait()
        return work

    def wait_all(self) -> None:
        """Wait for every reduce-scatter issued while armed."""
        for work, _input, _output in self._pending:
            work.wait()
        self._pending = []
