"""The shared-memory barrier (:mod:`shardwise.comm.shm_barrier`), with threads standing in for
ranks over plain tensors: it orders what ranks wrote before it, and a rank that never arrives is
an error (at once when its process is gone, after the timeout otherwise), never a hang."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from shardwise.comm import shm_barrier


def _barriers(world: int, timeout_s: float = 60.0, pids=None) -> list[shm_barrier.SpinBarrier]:
    counters = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    return [shm_barrier.SpinBarrier(counters, r, timeout_s, pids) for r in range(world)]


def test_every_rank_sees_what_the_others_wrote_before_the_barrier() -> None:
    world, rounds = 3, 200
    barriers = _barriers(world)
    slots = torch.zeros(world, dtype=torch.int64)
    seen: list[list[bool]] = [[] for _ in range(world)]

    def rank(r: int) -> None:
        for k in range(1, rounds + 1):
            slots[r] = k
            barriers[r].wait()
            seen[r].append(bool((slots == k).all()))  # every rank wrote round k before its barrier
            barriers[r].wait()  # nobody writes round k + 1 before everyone has looked

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(len(s) == rounds and all(s) for s in seen)


def test_a_rank_that_never_arrives_times_out_with_the_limits_name() -> None:
    barrier = _barriers(2, timeout_s=0.5)[0]
    start = time.monotonic()
    with pytest.raises(
        RuntimeError, match=r"rank 1 did not reach the shared-memory barrier within 0 s.*SHARDWISE_TIMEOUT"
    ):
        barrier.wait()
    assert time.monotonic() - start < 5


def test_a_rank_whose_process_is_gone_fails_the_others_at_once() -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # reaped: its pid names no process now
    barrier = _barriers(2, timeout_s=600.0, pids=[os.getpid(), gone.pid])[0]
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=f"rank 1 \\(pid {gone.pid}\\) exited"):
        barrier.wait()
    assert time.monotonic() - start < 5  # not the 600 s timeout
