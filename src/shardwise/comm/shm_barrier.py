"""A barrier for the ranks of one host through shared memory (the shared-memory collectives' fence).

Why not the group's gloo barrier: each one is a round trip over loopback TCP, and a rank that
arrives first sleeps in the kernel until it is woken. Measured on the 17M GPT benchmark (2 ranks
x 1 thread, 512 tokens per rank, stage 1: four barriers per step), the time a rank spent in
barriers per step fell from 16-39 ms with gloo's barrier to 7-19 ms with this one; the rest is
the skew between the ranks, which no barrier removes.

How: every rank owns one counter in a shared page (an ``int64`` in its own buffer, so no two
ranks write one cache line). To pass barrier number ``g`` a rank fences its earlier stores (a
lock round trip: a locked instruction, which on x86 also drains non-temporal stores), writes
``g`` into its counter, and waits until every other counter has reached ``g``. It spins briefly,
then yields the core (``sched_yield``: no cost when nothing else wants it, no starvation when
ranks outnumber cores), then sleeps between looks once the wait is long (a rank saving a
checkpoint). A rank that never arrives is an error, never a hang: after the group's collective
timeout, or at once when a peer's process is found gone.

Only on x86-64, whose memory model (stores seen in order; loads not reordered with loads) makes
"data written, then counter written" visible in that order to a reader of the counter; elsewhere
:class:`~shardwise.comm.shared_memory.SharedMemoryGroup` uses the gloo barrier.
"""

from __future__ import annotations

import os
import platform
import threading
import time
from collections.abc import Sequence

import torch

_SPINS = 200  # looks before yielding the core (a look is ~1 us)
_YIELD_SECONDS = 0.01  # then yield between looks for this long, then sleep between looks
_SLEEP_SECONDS = 50e-6
_LIVENESS_SECONDS = 0.2  # how often a long wait checks that the late ranks' processes exist


def supported() -> bool:
    """Whether this machine's memory model suits the spinning barrier (x86-64)."""
    return platform.machine().lower() in ("x86_64", "amd64")


class SpinBarrier:
    """The barrier over counters ``counters[r]`` (a one-element int64 tensor per rank, all mapped
    here); ``pids``: the ranks' process ids when they share this process's pid namespace, to
    fail at once when one is gone (None: rely on the timeout)."""

    def __init__(
        self, counters: Sequence[torch.Tensor], rank: int, timeout_s: float, pids: Sequence[int] | None = None
    ) -> None:
        self._counters = list(counters)
        self._rank = rank
        self._timeout_s = timeout_s
        self._pids = list(pids) if pids is not None else None
        self._generation = int(self._counters[rank].item())
        self._fence = threading.Lock()

    def wait(self) -> None:
        """Return once every rank has called ``wait`` as many times as this rank has."""
        self._generation += 1
        generation = self._generation
        with self._fence:  # a locked instruction: earlier stores are visible before the counter's
            pass
        self._counters[self._rank].fill_(generation)
        for r, counter in enumerate(self._counters):
            if r != self._rank:
                self._wait_for(r, counter, generation)

    def _wait_for(self, r: int, counter: torch.Tensor, generation: int) -> None:
        for _ in range(_SPINS):
            if int(counter.item()) >= generation:
                return
        start = time.monotonic()
        checked = start
        while int(counter.item()) < generation:
            now = time.monotonic()
            if now - start < _YIELD_SECONDS:
                os.sched_yield()
                continue
            time.sleep(_SLEEP_SECONDS)
            if now - checked >= _LIVENESS_SECONDS:
                checked = now
                self._check(r, now - start)

    def _check(self, r: int, waited: float) -> None:
        if self._pids is not None and not _alive(self._pids[r]):
            raise RuntimeError(
                f"rank {self._rank}: rank {r} (pid {self._pids[r]}) exited before reaching the shared-memory "
                f"barrier; see that rank's output for why it stopped"
            )
        if waited > self._timeout_s:
            raise RuntimeError(
                f"rank {self._rank}: rank {r} did not reach the shared-memory barrier within "
                f"{self._timeout_s:.0f} s (it is stuck, or its program took another path); the limit is the "
                f"collective timeout (SHARDWISE_TIMEOUT_SECONDS, SHARDWISE_TIMEOUT or DEEPSPEED_TIMEOUT)"
            )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
