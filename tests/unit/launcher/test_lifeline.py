"""Parent-death signals (:mod:`shardwise.launcher.lifeline`): a process armed against its parent
dies when that parent is SIGKILLed (prctl and the polling fallback), a parent that died before
arming is noticed at once, the runner's ``preexec_fn`` does the same for what it starts, and a
rank arms only under shardwise's agent. Small ``python -c`` processes; launches are in
``tests/integration/test_launch_lifeline.py``."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

import pytest

from shardwise.launcher.lifeline import AGENT_PID_VAR, preexec_die_with
from shardwise.launcher.worker import _die_with_agent

_PR_GET_PDEATHSIG = 2


def parent_death_signal() -> int:
    value = ctypes.c_int(-1)
    assert ctypes.CDLL(None).prctl(_PR_GET_PDEATHSIG, ctypes.byref(value), 0, 0, 0) == 0
    return value.value


def is_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as handle:
            return handle.read().rpartition(")")[2].split()[0] != "Z"  # a zombie has died
    except FileNotFoundError:
        return False


def wait_dead(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while is_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not is_alive(pid)


def kill_middle_and_check_child_dies(middle_code: str) -> None:
    """Run ``middle_code`` (it starts a child and prints ``child <pid>``, the child prints ``armed``),
    SIGKILL the middle process, and require the child to die within 5 s."""
    middle = subprocess.Popen([sys.executable, "-c", middle_code], stdout=subprocess.PIPE, text=True)
    assert middle.stdout is not None
    lines = {middle.stdout.readline().split()[0] for _ in range(2)}
    child = int(next(line for line in lines if line.isdigit()))
    assert "armed" in lines
    middle.kill()
    middle.wait()
    try:
        assert wait_dead(child, 5.0), "the child outlived its parent"
    finally:
        if is_alive(child):
            os.kill(child, signal.SIGKILL)


CHILD = (
    "import os, signal, sys, time\n"
    "from shardwise.launcher.lifeline import die_with_parent\n"
    "die_with_parent(signal.SIGKILL, os.getppid(), use_prctl={use_prctl}, poll_interval=0.05)\n"
    "print('armed', flush=True)\n"
    "time.sleep(60)\n"
)


@pytest.mark.parametrize("use_prctl", [True, False], ids=["prctl", "polling-thread"])
def test_an_armed_process_dies_when_its_parent_is_sigkilled(use_prctl: bool) -> None:
    middle = (
        "import subprocess, sys, time\n"
        f"child = subprocess.Popen([sys.executable, '-c', {CHILD.format(use_prctl=use_prctl)!r}])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    kill_middle_and_check_child_dies(middle)


@pytest.mark.parametrize("use_prctl", [True, False], ids=["prctl", "polling-thread"])
def test_a_parent_that_died_before_arming_is_noticed_at_once(use_prctl: bool) -> None:
    # The "parent" passed is not this process's parent: as if it had died before the call.
    code = (
        "import os, signal\n"
        "from shardwise.launcher.lifeline import die_with_parent\n"
        f"die_with_parent(signal.SIGTERM, os.getpid(), use_prctl={use_prctl})\n"
        "print('survived', flush=True)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == -signal.SIGTERM and "survived" not in result.stdout


def test_preexec_arms_what_the_runner_starts_and_kills_an_orphan_before_exec() -> None:
    middle = (
        "import os, signal, subprocess, sys, time\n"
        "from shardwise.launcher.lifeline import preexec_die_with\n"
        "code = \"print('armed', flush=True); import time; time.sleep(60)\"\n"
        "child = subprocess.Popen([sys.executable, '-c', code],\n"
        "                         preexec_fn=preexec_die_with(os.getpid(), signal.SIGTERM))\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    kill_middle_and_check_child_dies(middle)
    # A parent pid that is not the child's parent: the child never runs its program.
    orphan = subprocess.Popen(
        [sys.executable, "-c", "print('ran')"],
        stdout=subprocess.PIPE,
        preexec_fn=preexec_die_with(0, signal.SIGTERM),
    )
    out, _ = orphan.communicate(timeout=60)
    assert orphan.returncode == -signal.SIGKILL and out == b""


def test_a_rank_arms_only_under_shardwises_agent_and_hides_the_agent_pid_from_the_script() -> None:
    before = parent_death_signal()
    env = {AGENT_PID_VAR: str(os.getppid())}  # no TORCHELASTIC_RUN_ID: not under torchrun
    _die_with_agent(env)
    assert AGENT_PID_VAR not in env and parent_death_signal() == before
    code = (
        "import ctypes, os\n"
        "from shardwise.launcher.worker import _die_with_agent\n"
        f"env = {{'{AGENT_PID_VAR}': str(os.getppid()), 'TORCHELASTIC_RUN_ID': 'x'}}\n"
        "_die_with_agent(env)\n"
        "value = ctypes.c_int(-1)\n"
        f"ctypes.CDLL(None).prctl({_PR_GET_PDEATHSIG}, ctypes.byref(value), 0, 0, 0)\n"
        f"print(value.value, '{AGENT_PID_VAR}' in env)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(int(signal.SIGKILL)), "False"]
