"""DeepSpeed's pipeline schedules as instruction streams (``deepspeed.runtime.pipe.schedule``).

A schedule yields, step by step, the instructions one stage executes; a barrier may sit between
steps without deadlock. :class:`TrainSchedule` is DeepSpeed's synchronous 1F1B: at step ``t``
stage ``s`` runs a forward when ``t`` and ``s`` have the same parity (micro batch ``(t - s) // 2``)
and otherwise a backward (micro batch ``(t + s + 1) // 2 - stages``), for
``2 * (micro_batches + stages - 1)`` steps. shardwise's engine runs the same order through
``torch.distributed.pipelining`` (:mod:`shardwise.pipe.executor`); these classes describe it and
serve scripts and tests that read DeepSpeed's schedules.

Example:
    >>> [type(c).__name__ for c in next(iter(TrainSchedule(micro_batches=2, stages=2, stage_id=0)))]
    ['LoadMicroBatch', 'ForwardPass']
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any


class PipeInstruction:
    """One instruction of a schedule; its keyword arguments become attributes."""

    def __init__(self, **kwargs: Any) -> None:
        self.name = type(self).__name__
        self.kwargs = kwargs
        for key, value in kwargs.items():
            setattr(self, key, value)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.kwargs.items())
        return f"{self.name}({args})"


class OptimizerStep(PipeInstruction):
    """Step the optimizer and zero the gradients (after the gradient reductions)."""


class ReduceGrads(PipeInstruction):
    """Reduce gradients over the data-parallel ranks of this stage."""


class ReduceTiedGrads(PipeInstruction):
    """Sum the gradients of tied modules over the stages that hold them."""


class BufferOpInstruction(PipeInstruction):
    """An instruction on pipeline buffer ``buffer_id``."""

    def __init__(self, buffer_id: int, **kwargs: Any) -> None:
        super().__init__(buffer_id=buffer_id, **kwargs)


class LoadMicroBatch(BufferOpInstruction):
    """Read the next micro batch into a buffer (first and last stages)."""


class ForwardPass(BufferOpInstruction):
    """Run the stage's forward on a buffer."""


class BackwardPass(BufferOpInstruction):
    """Run the stage's backward on a buffer."""


class SendActivation(BufferOpInstruction):
    """Send a buffer's output activations to the next stage."""


class RecvActivation(BufferOpInstruction):
    """Receive activations from the previous stage into a buffer."""


class SendGrad(BufferOpInstruction):
    """Send the gradient of a buffer's inputs to the previous stage."""


class RecvGrad(BufferOpInstruction):
    """Receive the gradient of a buffer's outputs from the next stage."""


class PipeSchedule(ABC):
    """A schedule for one stage: iterate it for the instruction lists of each step.

    Args:
        micro_batches: micro batches per batch.
        stages: pipeline stages.
        stage_id: the stage this schedule drives.
    """

    def __init__(self, micro_batches: int, stages: int, stage_id: int) -> None:
        self.micro_batches = micro_batches
        self.stages = stages
        self.stage_id = stage_id
        self.prev_stage = stage_id - 1
        self.next_stage = stage_id + 1
        self.it: Iterator[list[PipeInstruction]] | None = None

    @abstractmethod
    def steps(self) -> Iterator[list[PipeInstruction]]:
        """Yield the instructions of each step."""

    def num_pipe_buffers(self) -> int:
        """Buffers the stage needs (by default one per micro batch)."""
        return self.micro_batches

    def _valid_micro_batch(self, micro_batch_id: int) -> bool:
        return 0 <= micro_batch_id < self.micro_batches

    def _valid_stage(self, stage_id: int) -> bool:
        return 0 <= stage_id < self.stages

    @property
    def stage(self) -> int:
        """The stage this schedule drives."""
        return self.stage_id

    @property
    def num_stages(self) -> int:
        """The number of stages."""
        return self.stages

    @property
    def num_micro_batches(self) -> int:
        """The number of micro batches."""
        return self.micro_batches

    @property
    def is_first_stage(self) -> bool:
        """This is stage 0."""
        return self.stage_id == 0

    @property
    def is_last_stage(self) -> bool:
        """This is the last stage."""
        return self.stage_id == self.stages - 1

    def _buffer_idx(self, micro_batch_id: int) -> int:
        """The buffer of a micro batch (cyclic)."""
        assert self._valid_micro_batch(micro_batch_id)
        return micro_batch_id % self.num_pipe_buffers()

    def __iter__(self) -> PipeSchedule:
        self.it = None
        return self

    def __next__(self) -> list[PipeInstruction]:
        if self.it is None:
            self.it = self.steps()
        return next(self.it)


class InferenceSchedule(PipeSchedule):
    """Forward-only pipelining: micro batch ``t - s`` at step ``t`` on stage ``s``, two buffers."""

    def steps(self) -> Iterator[list[PipeInstruction]]:
        """The forward-only steps."""
        even_stage = self.stage_id % 2 == 0
        for step in range(self.micro_batches + self.stages - 1):
            micro = step - self.stage_id
            recv_buf, send_buf = (step % 2, (step + 1) % 2) if even_stage else ((step + 1) % 2, step % 2)
            cmds: list[PipeInstruction] = []
            if (self.is_first_stage or self.is_last_stage) and self._valid_micro_batch(micro):
                cmds.append(LoadMicroBatch(recv_buf))
            send = self._valid_stage(self.next_stage) and self._valid_micro_batch(micro - 1)
            recv = self._valid_stage(self.prev_stage) and self._valid_micro_batch(micro)
            exchange = [SendActivation(send_buf)] * send + [RecvActivation(recv_buf)] * recv
            cmds.extend(exchange if even_stage else exchange[::-1])  # even stages send first: no deadlock
            if self._valid_micro_batch(micro):
                cmds.append(ForwardPass(recv_buf))
            yield cmds

    def num_pipe_buffers(self) -> int:
        """Two buffers: one receiving, one sending."""
        return 2


class TrainSchedule(PipeSchedule):
    """DeepSpeed's synchronous 1F1B training schedule (see the module docstring)."""

    def _step_to_micro_batch(self, step: int) -> tuple[int, bool]:
        if step % 2 == self.stage_id % 2:
            return (step - self.stage_id) // 2, True
        return (step + self.stage_id + 1) // 2 - self.stages, False

    def steps(self) -> Iterator[list[PipeInstruction]]:
        """The 1F1B steps; the last one reduces tied and data-parallel gradients and steps."""
        total = 2 * (self.micro_batches + self.stages - 1)
        prev_micro = -1
        for step in range(total):
            micro, forward = self._step_to_micro_batch(step)
            prev_ok, cur_ok = self._valid_micro_batch(prev_micro), self._valid_micro_batch(micro)
            prev_buf = self._buffer_idx(prev_micro) if prev_ok else None
            cur_buf = self._buffer_idx(micro) if cur_ok else None
            cmds: list[PipeInstruction] = []
            if forward:
                if prev_buf is not None and self._valid_stage(self.prev_stage):
                    cmds.append(SendGrad(prev_buf))
                if cur_buf is not None and self._valid_stage(self.prev_stage):
                    cmds.append(RecvActivation(cur_buf))
            else:
                if cur_buf is not None and self._valid_stage(self.next_stage):
                    cmds.append(RecvGrad(cur_buf))
                if prev_buf is not None and self._valid_stage(self.next_stage):
                    cmds.append(SendActivation(prev_buf))
            if (self.is_first_stage or self.is_last_stage) and forward and cur_buf is not None:
                cmds.append(LoadMicroBatch(cur_buf))
            if cur_buf is not None:
                cmds.append(ForwardPass(cur_buf) if forward else BackwardPass(cur_buf))
            if step == total - 1:
                cmds.extend([ReduceTiedGrads(), ReduceGrads(), OptimizerStep()])
            prev_micro = micro
            yield cmds

    def num_pipe_buffers(self) -> int:
        """Forwards in flight: ``stages - stage_id`` (at most the micro batches), at least 2."""
        return max(2, min(self.stages - self.stage_id, self.micro_batches))


class DataParallelSchedule(PipeSchedule):
    """No pipelining: each micro batch loads, runs forward and backward; the last one steps."""

    def steps(self) -> Iterator[list[PipeInstruction]]:
        """One step per micro batch."""
        for step in range(self.micro_batches):
            cmds: list[PipeInstruction] = [LoadMicroBatch(0), ForwardPass(0), BackwardPass(0)]
            if step == self.micro_batches - 1:
                cmds.extend([ReduceGrads(), OptimizerStep()])
            yield cmds

    def num_pipe_buffers(self) -> int:
        """One buffer."""
        return 1
