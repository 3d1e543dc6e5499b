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
from typing import Any


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


def _drain(activity: queue.Queue[str | None], open_streams: int, wait: float = 10.0) -> None:
    """Wait (briefly) for the reader threads to reach the end of the killed session's output."""
    try:
        while open_streams:
            if activity.get(timeout=wait) is None:
                open_streams -= 1
    except queue.Empty:
        pass


def run_watched(command: Sequence[str], *, cwd: Path | str, env: dict[str, str], limit: float) -> WatchedRun:
    """Run ``command``, killing its process group when it prints nothing for ``limit`` seconds.

    ``lines`` are its standard output's lines, then its standard error's (kept apart: a test's
    partial ``path::name`` line on stdout must not run into a child's stderr text); output on either
    stream counts as activity.

    Example:
        >>> run = run_watched(["echo", "hi"], cwd=".", env=dict(os.environ), limit=30)
        >>> run.lines, run.returncode, run.killed
        (['hi'], 0, False)
    """
    proc = subprocess.Popen(
        list(command),
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: killpg reaches forked tests and spawned ranks
    )
    activity: queue.Queue[str | None] = queue.Queue()
    streams: dict[str, list[str]] = {"out": [], "err": []}

    def pump(name: str, source: Any) -> None:
        for line in source:
            streams[name].append(line.rstrip("\n"))
            activity.put(name)
        activity.put(None)

    for name, source in (("out", proc.stdout), ("err", proc.stderr)):
        threading.Thread(target=pump, args=(name, source), daemon=True).start()
    run = WatchedRun()
    open_streams = 2
    deadline = time.monotonic() + limit
    while open_streams:
        try:
            event = activity.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            run.killed = True
            kill_group(proc)
            _drain(activity, open_streams)  # the partial line naming the test that hung
            break
        if event is None:
            open_streams -= 1
        deadline = time.monotonic() + limit
    run.returncode = proc.wait()
    if not run.killed:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # the session ended; what it left in its group goes too
    run.lines = streams["out"] + streams["err"]
    return run
