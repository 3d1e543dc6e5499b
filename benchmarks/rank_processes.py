"""Starting and waiting for a benchmark's rank processes, shared by the drivers (``engine_core.py``,
``nvme_offload_bench.py``, ``activation_checkpointing_bench.py``, ``checkpoint_bench.py``): a free
rendezvous port, the line of a rank's output that says why it failed, and the wait (once one rank
fails, its partners would sit in gloo's timeout, so they are stopped after a short grace; anything
still running at the deadline is killed)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from collections.abc import Callable
from typing import Any


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


def run_json_ranks(cmd: list[str], world: int, timeout: float, what: str, **env: str) -> list[dict[str, Any]]:
    """Run ``cmd`` as ``world`` local ranks (gloo rendezvous on a free port, ``OMP_NUM_THREADS=1``,
    extra ``env``); each rank prints its result as a JSON line last. Returns the ranks' results, or
    raises RuntimeError naming ``what`` with the first failing rank's error line."""
    port, procs = free_port(), []
    for rank in range(world):
        rank_env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                        LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                        OMP_NUM_THREADS="1", **env)  # fmt: skip
        procs.append(subprocess.Popen(cmd, env=rank_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    wait_ranks(procs, time.monotonic() + timeout, grace=10.0, poll=0.2)
    results = []
    for proc in procs:
        out, err = proc.communicate()
        lines = [line for line in out.decode().splitlines() if line.startswith("{")]
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"{what}: {last_error_line(err.decode() + out.decode())}")
        results.append(json.loads(lines[-1]))
    return results


def best_of_alternating(run: Callable[[str], dict[str, Any]], key: str = "cpu_ms_min") -> dict[str, dict[str, Any]]:
    """Each peer's best result (least ``key``) over two rounds, shardwise then DeepSpeed, then the reverse
    order, so drifting machine load hits both alike. ``run(peer)`` runs one peer and returns its result."""
    best: dict[str, dict[str, Any]] = {}
    for order in (("shardwise", "deepspeed"), ("deepspeed", "shardwise")):
        for peer in order:
            result = run(peer)
            if peer not in best or result[key] < best[peer][key]:
                best[peer] = result
    return best
