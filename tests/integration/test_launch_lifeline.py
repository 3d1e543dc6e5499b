"""Acceptance: no rank outlives its launcher. SIGKILL to the launcher's process group (the
launcher alone: its agents and their ranks run in sessions of their own) leaves no rank
alive after 10 s; SIGKILL to one node's agent ends that node's ranks and the launch."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from launch_helpers import DIST_MODES, environment, free_port, shardwise_command

pytestmark = pytest.mark.integration

RANKS = 2


def is_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped by its new parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as handle:
            return handle.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat", encoding="utf-8") as handle:
        return int(handle.read().rpartition(")")[2].split()[1])


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.2)


def start_forever(tmp_path: Path) -> tuple[subprocess.Popen[bytes], list[int]]:
    """The launcher in a process group of its own (as a shell job), and its ranks' pids."""
    argv = [*shardwise_command(), "--num_gpus", str(RANKS), "--master_port", str(free_port()),
            str(DIST_MODES), "forever"]  # fmt: skip
    with open(tmp_path / "launcher.log", "wb") as log:
        launcher = subprocess.Popen(
            argv, cwd=tmp_path, env=environment(tmp_path), stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    pid_files = [tmp_path / f"rank-{rank}.pid" for rank in range(RANKS)]

    def started() -> bool:
        if launcher.poll() is not None:
            raise AssertionError(
                f"the launch ended early:\n{(tmp_path / 'launcher.log').read_text()[-4000:]}"
            )
        return all(path.exists() for path in pid_files)

    wait_for(started, 240, "both ranks to write their pid")
    return launcher, [int(path.read_text()) for path in pid_files]


def assert_all_die(pids: list[int], within: float) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and any(is_alive(pid) for pid in pids):
        time.sleep(0.2)
    survivors = [pid for pid in pids if is_alive(pid)]
    assert not survivors, f"still alive {within:g}s later: {survivors}"


def cleanup(pids: list[int]) -> None:
    """Kill what a failed test left running (the processes this test started, still alive now)."""
    for pid in pids:
        if is_alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_sigkill_to_the_launchers_process_group_leaves_no_rank_alive(tmp_path) -> None:
    launcher, ranks = start_forever(tmp_path)
    agent = parent_of(ranks[0])
    try:
        # The agent and the ranks each have a session of their own: the signal reaches the launcher only.
        assert {os.getpgid(pid) for pid in [agent, *ranks]}.isdisjoint({launcher.pid})
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()
        assert_all_die([*ranks, agent], within=10)
    except BaseException:
        cleanup([*ranks, agent])
        raise


def test_sigkill_to_an_agent_ends_its_ranks_and_the_launch(tmp_path) -> None:
    launcher, ranks = start_forever(tmp_path)
    agent = parent_of(ranks[0])
    try:
        os.kill(agent, signal.SIGKILL)
        assert_all_die(ranks, within=10)
        assert launcher.wait(timeout=60) != 0
    except BaseException:
        cleanup([*ranks, launcher.pid])
        raise
