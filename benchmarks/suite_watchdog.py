"""Run one pytest session of the DeepSpeed suite with a watchdog that can always end it.

pytest-timeout and DeepSpeed's own harness timeout end most hung tests, but a test can hang where
neither reaches (a forked child blocked in a collective whose signal handler never runs, a spawned
rank that outlives its parent). Then ``subprocess.run`` waits forever and the whole suite stops.

:func:`run_watched` starts the command in its own process group, reads its output line by line
(on a thread, so the wait has a deadline), and when no line has arrived for ``limit`` seconds it
kills the whole group (the session, its forked test children and any ranks they spawned) and says
so. The caller counts the test that was running as failed and runs the file again without it.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class WatchedRun:
    """What one watched session printed, how it ended, and whether the watchdog killed it."""

    lines: list[str] = field(default_factory=list)
    returncode: int = 0
    killed: bool = False


def kill_group(proc: subprocess.Popen[str]) -> None:
    """SIGKILL the process group ``proc`` leads (started with ``start_new_session``), then reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _drain(lines: queue.Queue[str | None], wait: float = 10.0) -> list[str]:
    """What the reader thread still delivers after a kill (until it sees the end of the output)."""
    rest: list[str] = []
    try:
        while (line := lines.get(timeout=wait)) is not None:
            rest.append(line)
    except queue.Empty:
        pass
    return rest


def run_watched(command: Sequence[str], *, cwd: Path | str, env: dict[str, str], limit: float) -> WatchedRun:
    """Run ``command``, killing its process group when it prints nothing for ``limit`` seconds.

    Example:
        >>> run = run_watched(["echo", "hi"], cwd=".", env=dict(os.environ), limit=30)
        >>> run.lines, run.returncode, run.killed
        (['hi'], 0, False)
    """
    proc = subprocess.Popen(
        list(command), cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,  # its own process group: killpg reaches forked tests and spawned ranks
    )
    assert proc.stdout is not None
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    run = WatchedRun()
    deadline = time.monotonic() + limit
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            run.killed = True
            kill_group(proc)
            run.lines.extend(_drain(lines))  # the partial line naming the test that hung
            break
        if line is None:
            break
        run.lines.append(line)
        deadline = time.monotonic() + limit
    run.returncode = proc.wait()
    if not run.killed:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # the session ended; what it left in its group goes too
    return run
