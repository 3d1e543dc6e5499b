"""The rank side of the test harness: what each spawned process runs.

Kept apart from the parent side so the children import only this (plus the package
``__init__``). Nothing here imports torch at the top, so a ``spawn`` rank's environment
(``OMP_NUM_THREADS``, the launcher variables, the caller's extras) is in place before torch loads
(a rank forked from the harness's forkserver has torch loaded already: its thread count is set
with ``torch.set_num_threads``), and unpickling the entry point costs nothing.

Messages to the parent are pickled tuples on a one-way pipe:
``("progress", text)``, ``("ok", result_pickle)`` or ``("error", phase, case, traceback)``.
"""

from __future__ import annotations

import atexit
import faulthandler
import multiprocessing
import os
import pickle
import signal
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

# Longest repr of a grid case quoted in messages.
_CASE_REPR_LIMIT = 200


@dataclass(frozen=True)
class RankSpec:
    """Everything one child needs, pickled by the spawn machinery."""

    rank: int
    world_size: int
    payload: bytes  # pickle of (fn, args, kwargs)
    backend: str
    collective_timeout_s: float
    num_threads: int
    env: dict[str, str]
    stack_file: str


# The pipe to the parent and the grid case being run, set only inside a child.
_parent_conn: Connection | None = None
_current_case: str | None = None


def send_message(conn: Connection, message: tuple[object, ...]) -> None:
    # Plain pickle, not the connection's ForkingPickler: importing torch registers
    # shared-memory reductions there, and a tensor sent that way can be lost when the child
    # exits before the parent has mapped it. Plain pickle copies tensors by value.
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _report_progress(text: str) -> None:
    """Tell the parent what this rank is doing, so a timeout can say where it was."""
    if _parent_conn is not None:
        send_message(_parent_conn, ("progress", text))


def _die_with_parent() -> None:
    """Ask Linux to kill this rank if the parent dies (e.g. pytest killed with -9)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        pass  # best effort: the parent's finally block still kills the ranks


def _wait_for_the_harness(limit_s: float) -> None:
    """Stay alive after reporting a failure until the harness kills this rank.

    Exiting at once would close this rank's sockets, and every peer waiting in a
    collective would fail with gloo's "Connection closed by peer", burying the real error
    under secondary ones. The harness kills all ranks right after the first report; the
    wait ends early only if the parent itself has gone.
    """
    parent = multiprocessing.parent_process()
    if parent is None:
        return
    wait([parent.sentinel], timeout=limit_s)


def worker_main(spec: RankSpec, conn: Connection) -> None:
    """Entry point of one rank: set up, run the user function, report, exit."""
    global _parent_conn
    _parent_conn = conn
    _die_with_parent()
    if hasattr(os, "setpgrp"):
        # Own process group, so the harness can kill this rank together with any
        # processes it started (DataLoader workers, subprocesses).
        os.setpgrp()
    stack_file = open(spec.stack_file, "w")  # noqa: SIM115 - must stay open for faulthandler
    if hasattr(signal, "SIGUSR1"):
        # On timeout the parent sends SIGUSR1 and reads this file: the Python stacks of
        # every thread, even while the main thread is blocked inside a C++ collective.
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    os.environ.clear()  # exactly the parent's environment plus the rank's variables
    os.environ.update(spec.env)

    phase = "start-up"
    try:
        import datetime

        import torch
        import torch.distributed as dist

        torch.set_num_threads(spec.num_threads)
        phase = "unpickling the function and its arguments"
        fn, args, kwargs = pickle.loads(spec.payload)
        phase = "process-group initialisation"
        if "nccl" in spec.backend and torch.cuda.is_available():
            # Without this every rank would create its NCCL communicator on GPU 0.
            torch.cuda.set_device(spec.rank % torch.cuda.device_count())
        dist.init_process_group(
            backend=spec.backend,
            rank=spec.rank,
            world_size=spec.world_size,
            timeout=datetime.timedelta(seconds=spec.collective_timeout_s),
        )
        # gloo's constructor can return on one rank while a peer is still finishing its handshake;
        # a rank whose test function returns at once would then tear the group down under that
        # peer ("Connection closed by peer" in connectFullMesh). Nobody leaves before all are in.
        dist.barrier()
        phase = "the test function"
        result = fn(spec.rank, spec.world_size, *args, **kwargs)
        phase = "pickling the return value"
        result_bytes = pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
        phase = "process-group destruction"
        dist.destroy_process_group()
    except BaseException:  # SystemExit and KeyboardInterrupt are failures of the rank too
        send_message(conn, ("error", phase, _current_case, traceback.format_exc()))
        sys.stdout.flush()
        sys.stderr.flush()
        _wait_for_the_harness(spec.collective_timeout_s)
        # Skip interpreter teardown: destructors of a process group whose peers are gone
        # can block, and the parent only needs the report.
        os._exit(1)
    send_message(conn, ("ok", result_bytes))
    sys.stdout.flush()
    sys.stderr.flush()
    # Run the exit handlers (multiprocessing's own, coverage's, the test's), then skip the
    # interpreter teardown, which takes a second or more with torch loaded and would be
    # paid by every rank of every spawn.
    atexit._run_exitfuncs()
    os._exit(0)


def _describe_case(index: int, total: int, case: object) -> str:
    text = repr(case)
    if len(text) > _CASE_REPR_LIMIT:
        text = text[: _CASE_REPR_LIMIT - 3] + "..."
    return f"case {index} of {total}: {text}"


def run_cases(
    rank: int,
    world_size: int,
    fn: Callable[..., object],
    cases: Sequence[object],
    args: tuple[object, ...],
    kwargs: dict[str, object],
) -> list[object]:
    """Rank-side loop of ``run_distributed_cases``: one result per case."""
    global _current_case
    results = []
    for index, case in enumerate(cases):
        _current_case = _describe_case(index, len(cases), case)
        _report_progress(_current_case)
        results.append(fn(rank, world_size, case, *args, **kwargs))
    _current_case = None
    return results
