"""Every node's agent: torchrun's elastic agent, tied to its parent and announced to its ranks.

``python -u -m shardwise.launcher.agent [torchrun options] -m shardwise.launcher.worker ...``
takes exactly ``python -m torch.distributed.run``'s arguments and runs it in this process
after these steps (:mod:`shardwise.launcher.lifeline`):

1. arm SIGTERM for the death of whoever started it, so the agent stops its ranks, as on
   Ctrl-C, when its launcher is killed. The local launcher has armed it already, before
   ``exec``, and checked that it was still alive then (``run_commands``); this covers the
   remote nodes, where the parent is the shell that ssh/pdsh started;
2. put its pid in ``SHARDWISE_AGENT_PID`` for the ranks, so each rank can tie itself to
   this agent and see whether it died before the rank was ready;
3. on SIGTERM, send SIGCONT to its ranks before torchrun stops them: a rank stopped by
   SIGSTOP (a hang) otherwise keeps its SIGTERM pending for torchrun's whole 30 s grace;
4. in a fixed-size multi-node job (static rendezvous, ``--nnodes`` > 1): when this agent
   gives up (its ranks failed, out of restarts) it says so under :data:`JOB_FAILED_KEY` in
   the rendezvous store, and every agent watches that key and stops its ranks when it
   appears. Without it, a node whose rank hangs (SIGSTOP, a dead GPU) never fails by
   itself, so a runner that waits for every node (pdsh) waits forever while the other nodes
   have long given up; the launcher then restarts the job (``--max_restarts``).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from types import FrameType

from shardwise.launcher.lifeline import AGENT_PID_VAR, die_with_parent
from shardwise.utils.logging import logger

__all__ = ["JOB_FAILED_KEY", "main", "static_job"]

JOB_FAILED_KEY = "shardwise/job_failed"
"""Set in the rendezvous store by the agent of a fixed-size multi-node job that gave up."""

_WATCH_INTERVAL_S = 1.0


def static_job(argv: Sequence[str]) -> tuple[str, int, int] | None:
    """``(master_addr, master_port, node_rank)`` of a fixed-size multi-node launch, from
    torchrun's options (up to the program); None for one node or an elastic (c10d) job.

    Example:
        >>> static_job(["--nnodes=3", "--rdzv-backend=static", "--master-addr=h0", "--master-port=29500",
        ...             "--node-rank=2", "-m", "shardwise.launcher.worker", "--", "t.py", "--nnodes=9"])
        ('h0', 29500, 2)
        >>> static_job(["--nnodes=1", "--rdzv-backend=static", "--master-addr=h0", "--master-port=1"]) is None
        True
    """
    options: dict[str, str] = {}
    for item in argv:
        if not item.startswith("--"):
            break  # the program and its arguments
        name, _, value = item[2:].partition("=")
        options.setdefault(name, value)
    nnodes = options.get("nnodes", "1")
    if options.get("rdzv-backend") != "static" or not nnodes.isdigit() or int(nnodes) < 2:
        return None
    if "master-addr" not in options or not options.get("master-port", "").isdigit():
        return None
    return options["master-addr"], int(options["master-port"]), int(options.get("node-rank", "0") or 0)


def _children() -> list[int]:
    """The pids of this process's children (torchrun's ranks), from ``/proc``."""
    me, found = os.getpid(), []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8") as handle:
                if int(handle.read().rsplit(")", 1)[1].split()[1]) == me:
                    found.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
    return found


def _continue_children() -> None:
    """SIGCONT to every child of this process (torchrun's ranks)."""
    for pid in _children():
        try:
            os.kill(pid, signal.SIGCONT)
        except OSError:
            continue


def _on_sigterm(signum: int, _frame: FrameType | None) -> None:
    """Wake stopped ranks, then what torchrun's own handler does: raise its SignalException."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    _continue_children()
    sig = signal.Signals(signum)
    raise SignalException(f"Process {os.getpid()} got signal: {sig}", sigval=sig)


def _connect(host: str, port: int, timeout_s: float):  # -> torch Store
    from shardwise.comm.init import store_client

    return store_client(host, port, timedelta(seconds=timeout_s))


_given_up = threading.Event()  # this agent announced its own failure: stop watching


def _watch(host: str, port: int) -> None:
    """Poll the rendezvous store; SIGTERM this agent once another agent announced a failure."""
    store = None
    while not _given_up.wait(_WATCH_INTERVAL_S):
        try:
            if store is None:
                # Only while this node runs ranks: the rendezvous store is up then (a store client
                # that fails to connect is avoided; the agent once aborted in one, "terminate called
                # without an active exception"), and a finished job's store may be gone.
                if not _children():
                    continue
                store = _connect(host, port, 30.0)
            if store.check([JOB_FAILED_KEY]):
                failed = store.get(JOB_FAILED_KEY).decode(errors="replace")
                logger.warning("node %s gave up on the job; stopping this node's ranks", failed)
                os.kill(os.getpid(), signal.SIGTERM)
                return
        except Exception:  # the store is not up yet, or gone with its node: try again
            store = None


def _announce_failure(host: str, port: int, node_rank: int) -> None:
    """Tell the other agents this job failed; the store's host lingers so they can read it."""
    _given_up.set()
    try:
        _connect(host, port, 5.0).set(JOB_FAILED_KEY, str(node_rank))
    except Exception as error:  # its host is gone: the others find out by their own timeouts
        logger.warning("could not tell the other nodes that node %d failed: %s", node_rank, error)
        return
    if node_rank == 0:  # this agent serves the store: keep it up until every watcher has polled
        time.sleep(3 * _WATCH_INTERVAL_S)


def main(argv: Sequence[str] | None = None) -> None:
    """Arm the parent-death signal, announce this pid, watch the job, run torchrun's ``main``."""
    die_with_parent(signal.SIGTERM, os.getppid())
    os.environ[AGENT_PID_VAR] = str(os.getpid())
    args = list(sys.argv[1:] if argv is None else argv)
    job = static_job(args)
    from torch.distributed.run import get_args_parser

    if "--signals-to-handle" in get_args_parser()._option_string_actions and not any(
        a.startswith(("--signals-to-handle", "--signals_to_handle")) for a in args
    ):
        # torchrun installs its SIGTERM handler each time it starts ranks unless told not to
        # handle SIGTERM: this agent's handler wakes stopped ranks first, then does the same.
        args.insert(0, "--signals-to-handle=SIGINT,SIGHUP,SIGQUIT")
        signal.signal(signal.SIGTERM, _on_sigterm)
    if job is not None:
        threading.Thread(target=_watch, args=job[:2], name="shardwise-job-watch", daemon=True).start()
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun_main

    sys.argv[0] = "torchrun"  # torchrun's usage and error lines name itself, as before
    try:
        torchrun_main(args)
    except (SignalException, KeyboardInterrupt):
        raise  # stopped from outside: whoever stopped it stops the other nodes
    except BaseException as error:  # torchrun's ChildFailedError: this node's ranks failed for good
        if job is not None and not (isinstance(error, SystemExit) and error.code in (0, None)):
            _announce_failure(*job)
        raise


if __name__ == "__main__":
    main()
