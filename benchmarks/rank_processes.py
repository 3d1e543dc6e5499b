"""Starting and waiting for a benchmark's rank processes, shared by the drivers (``engine_core.py``,
``nvme_offload_bench.py``, ``activation_checkpointing_bench.py``, ``checkpoint_bench.py``): a free
rendezvous port, the line of a rank's output that says why it failed, and the wait (once one rank
fails, its partners would sit in gloo's timeout, so they are stopped after a short grace; anything
still running at the deadline is killed)."""

from __future__ import annotations

import socket
import subprocess
import time


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for ``MASTER_PORT``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def last_error_line(text: str, limit: int = 400) -> str:
    """The last line of ``text`` naming an error or exception (else its last line), cut to ``limit``."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    for line in reversed(lines):
        if "Error" in line or "Exception" in line:
            return line[:limit]
    return lines[-1][:limit] if lines else "no output"


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
