"""The schedules that run a pipeline: ``torch.distributed.pipelining`` stages and schedules.

The config's ``pipeline.schedule`` (a shardwise key) picks one of :data:`SCHEDULES`; the default,
``"1f1b"``, is DeepSpeed's order (:class:`~shardwise.pipe.schedule.TrainSchedule`: warm-up forwards,
then one forward and one backward alternating, then the cool-down backwards). Schedules with
several stages per rank need ``pipeline.virtual_stages`` (interleaved and looped: any count >= 2,
stages ``r, r + p, ...`` on rank ``r``; the V-shaped ZBV and DualPipeV: 2, stages ``r`` and
``2p - 1 - r``), and the PipelineModule is cut into ``p x virtual_stages`` chunks.

The executor hands torch each micro batch as it came from the data iterator (no concatenation or
re-splitting) and one loss function that records the raw loss and returns it divided by the
number of micro batches and multiplied by the loss scale, so gradients accumulate exactly as in
``engine.backward`` of a non-pipelined run (``scale_grads`` is off).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed import pipelining as tpp

from shardwise.comm.group_type import Group


@dataclass(frozen=True)
class ScheduleKind:
    """One offered schedule: the torch class, stages per rank (None: any >= 2) and the chunk placement."""

    name: str
    cls: type
    stages_per_rank: int | None
    placement: str  # "loop": r, r + p, ...; "v": r, 2p - 1 - r


SCHEDULES: dict[str, ScheduleKind] = {
    kind.name: kind
    for kind in (
        ScheduleKind("1f1b", tpp.Schedule1F1B, 1, "loop"),
        ScheduleKind("gpipe", tpp.ScheduleGPipe, 1, "loop"),
        ScheduleKind("interleaved_1f1b", tpp.ScheduleInterleaved1F1B, None, "loop"),
        ScheduleKind("looped_bfs", tpp.ScheduleLoopedBFS, None, "loop"),
        ScheduleKind("interleaved_zero_bubble", tpp.ScheduleInterleavedZeroBubble, None, "loop"),
        ScheduleKind("zbv_zero_bubble", tpp.ScheduleZBVZeroBubble, 2, "v"),
        ScheduleKind("dualpipev", tpp.ScheduleDualPipeV, 2, "v"),
    )
}


def check_schedule(name: str, virtual_stages: int) -> ScheduleKind:
    """The schedule ``name`` with ``virtual_stages`` stages per rank, or a ValueError naming the rule."""
    if name not in SCHEDULES:
        raise ValueError(
            f"pipeline.schedule = {name!r} is not a schedule shardwise offers; use one of {sorted(SCHEDULES)}"
        )
    kind = SCHEDULES[name]
    wanted = kind.stages_per_rank
    if wanted is not None and virtual_stages != wanted:
        raise ValueError(
            f"pipeline.schedule = {name!r} runs {wanted} stage(s) per rank, but pipeline.virtual_stages = "
            f"{virtual_stages}; set virtual_stages to {wanted}"
        )
    if wanted is None and virtual_stages < 2:
        raise ValueError(
            f"pipeline.schedule = {name!r} interleaves several stages per rank; set pipeline.virtual_stages "
            f"to 2 or more (got {virtual_stages})"
        )
    return kind


def chunk_stages(kind: ScheduleKind, stage_id: int, num_stages: int, virtual_stages: int) -> list[int]:
    """The global stage indices (of ``num_stages * virtual_stages``) rank ``stage_id`` runs, in order."""
    if kind.placement == "v":
        return [stage_id, 2 * num_stages - 1 - stage_id]
    return [stage_id + v * num_stages for v in range(virtual_stages)]


class ChunkModule(nn.Module):
    """One chunk of a stage's layers as the module torch's ``PipelineStage`` runs.

    It registers only the modules the chunk uses, so ``parameters()`` (read by zero-bubble
    schedules for their weight-gradient pass) are the chunk's own.
    """

    def __init__(self, run: Callable[[Any], Any], modules: list[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(modules)
        self._run = run

    def forward(self, *args: Any) -> Any:
        """The chunk's layers on the inputs (one tensor, or the tuple the previous chunk returned)."""
        return self._run(args[0] if len(args) == 1 else args)


class Executor:
    """Runs micro batches through this rank's stages with one torch schedule.

    Args:
        kind: the schedule.
        chunks: this rank's chunk modules, in the order of ``stage_indices``.
        stage_indices: their global stage indices.
        total_stages: stages in the whole pipeline (ranks x virtual stages).
        group: the pipeline group (None: the world).
        device: where activations live.
        loss: ``loss(output, target)`` on the stage that computes the loss.
    """

    def __init__(
        self,
        kind: ScheduleKind,
        chunks: list[ChunkModule],
        stage_indices: list[int],
        total_stages: int,
        group: Group,
        device: torch.device,
        loss: Callable[[Any, Any], torch.Tensor],
    ) -> None:
        self.kind = kind
        self.stages = [
            tpp.PipelineStage(chunk, index, total_stages, device, group=group)
            for chunk, index in zip(chunks, stage_indices)
        ]
        self.loss = loss
        self._schedules: dict[tuple[int, bool], Any] = {}

    @property
    def holds_loss(self) -> bool:
        """This rank runs the last stage (where the loss is computed)."""
        return any(s.is_last for s in self.stages)

    @property
    def holds_input(self) -> bool:
        """This rank runs stage 0 (which reads the inputs)."""
        return any(s.is_first for s in self.stages)

    def _schedule(self, micro_batches: int, with_loss: bool) -> Any:
        key = (micro_batches, with_loss)
        if key not in self._schedules:
            stage: Any = self.stages if self.kind.stages_per_rank != 1 else self.stages[0]
            self._schedules[key] = self.kind.cls(
                stage,
                n_microbatches=micro_batches,
                loss_fn=self.loss if with_loss else None,
                scale_grads=False,
            )
        return self._schedules[key]

    def run(
        self,
        n: int,
        inputs: list[Any] | None,
        targets: list[Any] | None,
        *,
        backward: bool,
        with_loss: bool = True,
    ) -> list[Any]:
        """One pass over ``n`` micro batches; returns the last stage's outputs (empty elsewhere).

        Args:
            n: the number of micro batches (every stage passes the same).
            inputs: each micro batch's inputs (a tensor or tuple) on the first stage, else None.
            targets: each micro batch's labels where the loss is computed (and ``with_loss``), else None.
            backward: run the backward passes (training) or forward only.
        """
        schedule = self._schedule(n, with_loss)
        for stage in self.stages:
            stage.has_backward = backward
            stage.clear_runtime_states()
        schedule._has_backward = backward
        arg_mbs = [x if isinstance(x, tuple) else (x,) for x in inputs] if inputs is not None else [()] * n
        kwarg_mbs: list[dict[str, Any]] = [{} for _ in range(n)]
        schedule._step_microbatches(arg_mbs, kwarg_mbs, targets if with_loss else None, None, True)
        for stage in self.stages:
            if stage.is_last:
                return list(stage.output_chunks)
        return []
