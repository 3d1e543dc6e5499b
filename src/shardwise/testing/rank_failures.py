"""What the harness of :mod:`shardwise.testing.multiprocess` knows about each rank while it watches
a run, and the error a test sees when one fails: ranks that raised (with their tracebacks, in the
order they failed), died (exit code or signal), or hung (their Python stacks at the timeout, taken
with ``faulthandler``)."""

from __future__ import annotations

import os
import pickle
import signal
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

# Seconds the harness waits for hung ranks to write their stacks before killing them.
_STACK_DUMP_WAIT_S = 1.0


class DistributedTestError(RuntimeError):
    """A distributed run failed: a rank raised, died, or the run timed out.

    Attributes:
        failures: rank -> the text the rank reported (its traceback), for ranks that raised.
        exit_codes: rank -> exit code (negative: killed by that signal) for ranks that died
            without reporting an exception.
        unfinished: ranks that were still running when the harness stopped and killed them.
        timed_out: whether the harness timeout expired.
    """

    def __init__(
        self,
        message: str,
        *,
        failures: dict[int, str] | None = None,
        exit_codes: dict[int, int] | None = None,
        unfinished: list[int] | None = None,
        timed_out: bool = False,
    ) -> None:
        super().__init__(message)
        self.failures = dict(failures or {})
        self.exit_codes = dict(exit_codes or {})
        self.unfinished = list(unfinished or [])
        self.timed_out = timed_out


@dataclass
class _RankState:
    """What the parent knows about one rank while it watches the run."""

    rank: int
    process: BaseProcess
    reader: Connection | None
    stack_file: str
    result: bytes | None = None
    error: tuple[str, str | None, str] | None = None  # (phase, case, traceback)
    progress: str | None = None
    exit_code: int | None = None
    failed_at: float = 0.0  # when the parent saw the error report or the death

    @property
    def died(self) -> bool:
        """Exited without an exception report, and without a result or non-zero after one."""
        return (
            self.error is None and self.exit_code is not None and (self.result is None or self.exit_code != 0)
        )

    @property
    def exited(self) -> bool:
        return self.exit_code is not None


def _drain(state: _RankState) -> None:
    """Read every message this rank has already sent, without blocking for new ones."""
    while state.reader is not None and state.reader.poll():
        try:
            message = pickle.loads(state.reader.recv_bytes())
        except (EOFError, OSError):
            # Writer closed (the rank exited), or killed in the middle of a message.
            state.reader.close()
            state.reader = None
            return
        kind = message[0]
        if kind == "progress":
            state.progress = message[1]
        elif kind == "ok":
            state.result = message[1]
        elif kind == "error":
            state.error = (message[1], message[2], message[3])
            state.failed_at = time.monotonic()


def _poll_exit(state: _RankState) -> None:
    """Record the exit code once the rank has exited, reading what it sent before."""
    if state.exit_code is None and state.process.exitcode is not None:
        state.exit_code = state.process.exitcode
        _drain(state)  # messages written just before the exit
        if state.died:
            state.failed_at = time.monotonic()


def _kill(state: _RankState) -> None:
    """Kill a rank (and its process group) that has not exited yet."""
    process = state.process
    if process.exitcode is not None or process.pid is None:
        return
    try:
        if hasattr(os, "killpg"):
            # The group id is the rank's pid once it has called setpgrp; before that no
            # such group exists and the ProcessLookupError falls back to killing the rank.
            os.killpg(process.pid, signal.SIGKILL)
        else:
            process.kill()
    except (ProcessLookupError, PermissionError):
        process.kill()


def _dump_stacks(states: list[_RankState]) -> dict[int, str]:
    """Ask hung ranks for their Python stacks (SIGUSR1 -> faulthandler) and read them."""
    if not hasattr(signal, "SIGUSR1"):
        return {}
    asked = []
    for state in states:
        if state.process.exitcode is None and state.process.pid is not None:
            try:
                os.kill(state.process.pid, signal.SIGUSR1)
                asked.append(state)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + _STACK_DUMP_WAIT_S
    stacks: dict[int, str] = {}
    previous: dict[int, str] = {}
    while asked and time.monotonic() < deadline:
        time.sleep(0.05)
        for state in list(asked):
            try:
                with open(state.stack_file) as handle:
                    text = handle.read()
            except OSError:
                continue
            # faulthandler writes one block per thread; done once the text stops growing.
            if text and text == previous.get(state.rank):
                stacks[state.rank] = text
                asked.remove(state)
            previous[state.rank] = text
    for state in asked:  # still writing at the deadline: keep what there is
        if previous.get(state.rank):
            stacks[state.rank] = previous[state.rank]
    return stacks


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name} (exit code {code})"
        except ValueError:
            return f"killed by signal {-code} (exit code {code})"
    return f"exit code {code}"


def _format_failure(
    states: list[_RankState],
    description: str,
    elapsed: float,
    *,
    timed_out: bool,
    stacks: dict[int, str],
    unfinished: list[int],
) -> DistributedTestError:
    """Build the error the test sees: failures in the order they happened, in full."""
    world_size = len(states)
    failures = {s.rank: s.error[2] for s in states if s.error is not None}
    died = {s.rank: s.exit_code for s in states if s.died and s.exit_code is not None}
    returned = [
        s.rank for s in states if s.result is not None and s.rank not in died and s.rank not in unfinished
    ]

    if timed_out:
        head = (
            f"{description} timed out after {elapsed:.1f} s: rank(s) {unfinished} of {world_size} had not "
            "finished. A rank waiting in a collective that another rank skipped, or that the ranks "
            "call in different orders, hangs like this."
        )
    else:
        parts = []
        if failures:
            parts.append(f"rank(s) {sorted(failures)} raised")
        if died:
            parts.append(f"rank(s) {sorted(died)} died")
        head = f"{description} failed after {elapsed:.1f} s: {' and '.join(parts)}"
        if unfinished:
            head += f"; rank(s) {unfinished} had not finished and were killed"
        head += "."
    if returned:
        head += f" Rank(s) {returned} had returned normally."

    # The first failure is usually the cause; later ones are often peers noticing that it
    # left (gloo's "Connection closed by peer"), so list failures in the order seen.
    failed = sorted((s for s in states if s.error is not None or s.died), key=lambda s: s.failed_at)
    sections = [head]
    for position, state in enumerate(failed):
        first = " (first failure)" if position == 0 and len(failed) > 1 else ""
        if state.error is not None:
            phase, case, text = state.error
            where = f" during {phase}" + (f" ({case})" if case else "")
            sections.append(f"----- rank {state.rank} raised{where}{first} -----\n{text.rstrip()}")
        elif state.result is not None:
            code = died[state.rank]
            sections.append(
                f"----- rank {state.rank} returned, then exited with {_exit_text(code)}{first} -----"
            )
        else:
            code = died[state.rank]
            last = f"; last progress: {state.progress}" if state.progress else ""
            sections.append(
                f"----- rank {state.rank} died without raising: {_exit_text(code)}{last}{first} -----\n"
                "(os._exit, a crash in native code or the OOM killer; its stderr is in the captured output)"
            )
    for state in states:
        if state.rank in unfinished:
            where = f" (last progress: {state.progress})" if state.progress else ""
            stack = stacks.get(state.rank)
            body = f"\nPython stacks at the timeout:\n{stack.rstrip()}" if stack else ""
            sections.append(
                f"----- rank {state.rank} had not finished{where}; killed by the harness -----{body}"
            )
    return DistributedTestError(
        "\n".join(sections),
        failures=failures,
        exit_codes=died,
        unfinished=unfinished,
        timed_out=timed_out,
    )
