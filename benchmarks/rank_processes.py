"""Waiting for a benchmark's rank processes, shared by the drivers (``engine_core.py``,
``nvme_offload_bench.py``): once one rank fails, its partners would sit in gloo's timeout, so
they are stopped after a short grace; anything still running at the deadline is killed."""

from __future__ import annotations

import subprocess
import time


def wait_ranks(procs: list[subprocess.Popen[bytes]], deadline: float, grace: float, poll: float) -> bool:
    """Wait for every process until ``deadline`` (``time.monotonic()``), or ``grace`` seconds after the
    first non-zero exit; kill what is left. Returns True when something had to be killed."""
    failed_at: float | None = None
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
            failed_at = now
        if now > deadline or (failed_at is not None and now - failed_at > grace):
            break
        time.sleep(poll)
    timed_out = any(p.poll() is None for p in procs)
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    return timed_out
