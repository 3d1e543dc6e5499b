"""How a collective's result is finished: :class:`CommHandle` and the steps every collective shares.

A collective in :mod:`shardwise.comm.collectives` starts the communication, then hands
:func:`_run` the ``Work`` and a finishing step (copying a slice out, dividing for an average,
copying back a CPU tensor that travelled through the GPU for NCCL): a synchronous call finishes
at once, an asynchronous one returns a :class:`CommHandle` whose ``wait()`` finishes it. The
comms logger's record (:func:`_record`) completes with it.

Example:
    >>> # handle = all_reduce(t, op="avg", async_op=True); handle.wait()  # t is averaged here
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from shardwise.comm.comms_logger import COMMS_LOGGER as _COMMS
from shardwise.comm.comms_logger import PendingComm


class CommHandle:
    """A Work-like handle: ``wait()`` waits for the collective, then finishes the result.

    The finishing step (copying a slice out of an all-reduced buffer, dividing for an
    average) runs exactly once, on the first ``wait()``. Until then the tensors passed to
    the collective must not be read or written.
    """

    def __init__(
        self,
        work: dist.Work | None,
        finish: Callable[[], object] | None = None,
        record: PendingComm | None = None,
    ) -> None:
        self._work = work
        self._finish = finish
        self._record = record
        self._done = False

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until the result is complete (on CUDA: ordered on the current stream)."""
        if not self._done:
            if self._work is not None:
                if timeout is None:
                    self._work.wait()
                else:
                    self._work.wait(timeout)
            if self._finish is not None:
                self._finish()
            self._done = True
            if self._record is not None:  # the comms logger is on
                self._record.complete()
        return True

    def is_completed(self) -> bool:
        """Whether ``wait()`` has already finished the result."""
        return self._done

def _record(op: str, tensor: torch.Tensor, world: int, prof: bool = False, log_name: str | None = None) -> PendingComm | None:
    """Start timing a collective for the comms logger (called only while it is enabled): under ``log_name``
    (default ``op``), also when not selected if ``prof`` (deepspeed.comm's ``prof``/``log_name`` arguments)."""
    return _COMMS.start(log_name or op, tensor.numel() * tensor.element_size(), world, tensor.is_cuda, force=prof)


def _nccl_staging(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor | None:
    """NCCL moves GPU memory only: a CPU tensor given to an NCCL group (the bookkeeping collectives:
    sizes, digests, byte payloads) travels through a copy on this rank's GPU. None where no copy is
    needed (gloo, or a tensor already on the GPU), so CPU groups run exactly as before."""
    # cheapest test first: on a CPU-only machine every collective passes here (no backend lookup)
    if tensor.device.type != "cpu" or not torch.cuda.is_available() or "nccl" not in str(dist.get_backend(group)):
        return None
    return tensor.to(torch.device("cuda", torch.cuda.current_device()))


def _copy_back(
    finish: Callable[[], object] | None, staged: torch.Tensor | None, tensor: torch.Tensor
) -> Callable[[], object] | None:
    """``finish``, then (when staged through the GPU) the result copied into the caller's CPU tensor."""
    if staged is None:
        return finish

    def done() -> None:
        if finish is not None:
            finish()
        tensor.copy_(staged)

    return done


def _run(
    work: dist.Work | None,
    async_op: bool,
    finish: Callable[[], object] | None,
    record: PendingComm | None = None,
) -> CommHandle | None:
    if record is not None and async_op:
        record.watch(work)
    handle = CommHandle(work, finish, record)
    if async_op:
        return handle
    handle.wait()
    return None
