"""Processes that die with their parent: node agents with the launcher, ranks with their agent.

The launcher starts every node's process in a session of its own, and torchrun's agent
starts every rank in a session of its own (``start_new_session``), so a signal to the
launcher's process group reaches neither, and nothing tells a process that its parent has
died: a SIGKILLed launcher used to leave its agents and their ranks training on their own.
Each link of the chain now arms a *parent-death signal* (Linux ``prctl(PR_SET_PDEATHSIG)``,
called through ctypes; elsewhere a daemon thread that polls ``getppid()`` every second):

==========================  ===========================  ==========  ==========================
process                     parent it watches            signal      armed by
==========================  ===========================  ==========  ==========================
agent, mpirun, srun, ssh,   the ``shardwise`` launcher   SIGTERM     :func:`preexec_die_with`
pdsh (what it starts)                                                (the runner's ``Popen``)
torchrun agent              whoever started it (the      SIGTERM     :mod:`shardwise.launcher.
                            launcher; a remote shell)                agent`, before torchrun
rank (worker)               its torchrun agent           SIGKILL     :mod:`shardwise.launcher.
                                                                     worker`, first thing
==========================  ===========================  ==========  ==========================

SIGTERM is how torchrun and the MPI/SLURM launchers stop a job (an agent that gets it stops
its ranks with SIGTERM, as on Ctrl-C). A rank gets SIGKILL: its agent is gone, so nothing
could stop, restart or report it any more. A rank killed during ``save_checkpoint`` leaves
no damaged checkpoint behind: a save writes into ``.<tag>.partial``, which is renamed to
``<tag>`` only once every rank's files are on disk, and ``latest`` moves last
(:mod:`shardwise.checkpoint.layout`); the previous tag stays loadable.

By launch path: ``local`` (and ``--no_ssh``): the whole chain above (tested in
``tests/integration/test_launch_lifeline.py``). ``ssh``/``pdsh``: the ssh/pdsh client ends
with the launcher; a remote agent stops when the remote shell that started it ends, which
sshd does not guarantee for a dropped connection without a terminal. ``openmpi``, ``mpich``,
``impi``, ``mvapich``, ``slurm``: mpirun or srun gets SIGTERM, which they pass on to their
ranks (their documented behaviour; no MPI or SLURM on the test machines); ranks do not arm
a signal themselves there (their parent is the process manager, not our agent).

``PR_SET_PDEATHSIG`` fires when the parent *thread* exits. The launcher starts its
processes from its main thread (``run_commands`` installs signal handlers, which only the
main thread may); torchrun's agent starts ranks from its main thread too (``agent.run()``
-> ``_start_workers`` -> ``start_processes``, which registers its signal handlers there).
The setting survives ``exec`` (not into set-uid programs) and is not inherited by children.
A parent that died before the signal was armed is caught by comparing ``getppid()`` with
the pid the parent announced.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

__all__ = ["AGENT_PID_VAR", "die_with_parent", "preexec_die_with", "set_parent_death_signal"]

AGENT_PID_VAR = "SHARDWISE_AGENT_PID"
"""Set by :mod:`shardwise.launcher.agent` to its pid; a rank arms its parent-death signal only
when its parent is that agent (never under mpirun/srun, whose process managers stop ranks)."""

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_libc: ctypes.CDLL | None = None


def _load_libc() -> ctypes.CDLL | None:
    global _libc
    if _libc is None and sys.platform.startswith("linux"):
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
        except OSError:  # a libc we cannot open: callers fall back to polling
            return None
    return _libc


def set_parent_death_signal(signum: int) -> bool:
    """Ask Linux to send ``signum`` to this process when its parent (thread) dies.

    Returns:
        Whether it is armed: False on other systems or where ``prctl`` refuses.

    Example:
        >>> set_parent_death_signal(0)  # signal 0: disarmed (True on Linux)
        True
    """
    libc = _load_libc()
    return libc is not None and libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0) == 0


def _watch_parent(signum: int, parent_pid: int, interval: float) -> None:
    while os.getppid() == parent_pid:
        time.sleep(interval)
    os.kill(os.getpid(), signum)


def die_with_parent(
    signum: int, parent_pid: int, *, use_prctl: bool = True, poll_interval: float = 1.0
) -> str:
    """Make this process receive ``signum`` once ``parent_pid`` (its parent) has died.

    Args:
        signum: the signal to receive.
        parent_pid: the parent this process was started by. If ``getppid()`` already
            differs, the parent died before this call: the signal is sent at once.
        use_prctl: False forces the polling thread (how other systems do it).
        poll_interval: seconds between the thread's ``getppid()`` checks.

    Returns:
        ``"prctl"`` or ``"thread"``: how the death will be noticed.
    """
    how = "prctl" if use_prctl and set_parent_death_signal(signum) else "thread"
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), signum)
    if how == "thread":
        threading.Thread(
            target=_watch_parent,
            args=(signum, parent_pid, poll_interval),
            name="shardwise-lifeline",
            daemon=True,
        ).start()
    return how


def preexec_die_with(parent_pid: int, signum: int) -> Callable[[], None]:
    """A ``Popen(preexec_fn=...)`` that arms ``signum`` for the child's parent ``parent_pid``.

    It runs in the child between ``fork`` and ``exec``: a child whose parent is already gone
    kills itself (SIGKILL; it has not started its program yet). Where ``prctl`` is missing
    it does nothing (a thread would not survive ``exec``).
    """
    _load_libc()  # in the parent: the child must not open libraries between fork and exec

    def arm() -> None:
        set_parent_death_signal(signum)
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), signal.SIGKILL)

    return arm
