"""Run a function on several ``torch.distributed`` ranks on one machine, for tests.

Each call starts ``world_size`` fresh rank processes, pins them to loopback and a free port,
sets the usual launcher variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``) over a copy of the parent's environment, initialises the process
group, calls ``fn(rank, world_size, *args, **kwargs)`` and sends the return value back to the parent.

Ranks are forked from a ``forkserver``: one clean, single-threaded server process per test session
that imported torch and the engine once (``_PRELOAD``), so a rank starts in milliseconds instead of
paying those imports (about 1.5 s of CPU per rank for torch and as much again for the engine's
torch.distributed.checkpoint/tensor, which dominated the suite on a 2-core machine). Never plain ``fork``: a child
forked from the parent would inherit its torch thread pools and locks. A forked rank is still a
fresh process for everything the tests look at: it gets the parent's current environment and
``sys.path`` (not the server's), its thread count is set with ``torch.set_num_threads``, and nothing
runs in the server but the imports. Environment variables that torch reads while it is imported
are the server's, which is the session's: the one such variable the suite changes,
``ATEN_CPU_CAPABILITY``, is set per pytest run (``make test-numerics``), before the server starts.
``SHARDWISE_HARNESS_START=spawn`` makes every rank a ``spawn`` process that imports torch itself.

The harness never hangs a test session:

* a rank that raises is reported with its full traceback and the other ranks are killed at
  once, without waiting for them to reach the collective timeout;
* a rank that dies without raising (``os._exit``, a segfault, the OOM killer) is reported
  with its exit code or signal;
* if the run exceeds ``timeout`` every rank is killed, and the error names the ranks that
  had not finished together with their Python stacks at that moment (taken with
  ``faulthandler``), which is usually enough to see which collective they were stuck in.

The process group is created with a collective timeout shorter than the harness timeout,
so a rank stuck in a collective whose partner never came usually fails with gloo's own
timeout error (and a traceback pointing at the collective) before the harness gives up.

``fn`` travels to the children by pickle, so it must be a function defined at module level
(importable by its qualified name); lambdas and functions defined inside a test do not
work. Functions in pytest test modules qualify under pytest's default ``prepend`` import
mode (the children inherit ``sys.path``). Its arguments and return value must be picklable
too; tensors come back by value.

Each call still costs the process group's set-up and the test module's imports in every rank,
so group many small checks into one call with :func:`run_distributed_cases`.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import wait
from multiprocessing.context import ForkServerContext, SpawnContext
from typing import Any

from shardwise.testing._rank import RankSpec, run_cases, worker_main
from shardwise.testing.rank_failures import (
    DistributedTestError,
    _drain,
    _dump_stacks,
    _format_failure,
    _kill,
    _poll_exit,
    _RankState,
)
from shardwise.utils.logging import logger

__all__ = [
    "DistributedTestError",
    "find_free_port",
    "run_distributed",
    "run_distributed_cases",
]

_LOOPBACK = "127.0.0.1"
# After the first failure, how long other ranks may still report (ranks failing together,
# a crash's exit code) before the harness kills them; short, so nothing waits on a hang.
_FAILURE_GRACE_S = 0.25


def find_free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago.

    The OS picks the port (bind to port 0); another process may still take it before
    rank 0 binds it, which :func:`run_distributed` handles by retrying once.

    Example:
        >>> port = find_free_port()
        >>> 0 < port < 65536
        True
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((_LOOPBACK, 0))
        return int(sock.getsockname()[1])


def _available_cpus() -> int:
    # The affinity mask is what this process may use (containers, taskset); cpu_count is
    # the machine's total.
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def _rank_env(
    rank: int, world_size: int, port: int, extra: dict[str, str] | None, threads: int
) -> dict[str, str]:
    env = dict(os.environ)  # the parent's, as it is now (a forked rank would get the server's)
    env |= {
        # world_size ranks share the cores, and oversubscription makes small CPU tests crawl
        # (the rank also calls torch.set_num_threads: torch may be loaded before this is read).
        "OMP_NUM_THREADS": str(threads),
        "MASTER_ADDR": _LOOPBACK,
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        # Set by torchrun's agent; if inherited it would make rank 0 a store client.
        "TORCHELASTIC_USE_AGENT_STORE": "False",
    }
    if sys.platform.startswith("linux"):
        # gloo otherwise picks the interface the hostname resolves to, which may not be
        # reachable in a sandbox; the ranks only ever talk over loopback.
        env["GLOO_SOCKET_IFNAME"] = "lo"
    elif sys.platform == "darwin":
        env["GLOO_SOCKET_IFNAME"] = "lo0"
    if extra:
        env.update(extra)
    return env


#: what a forkserver loads once, so each rank forks with it already imported. Beyond torch, the
#: modules nearly every rank imports: the engine (it pulls in DCP, DTensor, FSDP, dynamo and sympy,
#: seconds of CPU per rank on a 2-core machine), the optimizers, the test models, and pytest (a rank
#: re-imports the parent's ``__main__``, which is pytest's under ``python -m pytest``, and the test
#: modules import it). None of them starts a thread or seeds a random generator (numpy.random stays
#: unloaded, so each rank seeds its own), and the variables read while they are imported (torch's
#: TORCH*/TORCHDYNAMO*, ``SHARDWISE_LOG_LEVEL``) are the session's, as for torch itself: no test sets
#: them per rank. A module that fails to import here is left to the rank, which reports the error.
_PRELOAD = [
    "torch",
    "torch.distributed",
    "shardwise.testing._rank",
    "shardwise.engine",
    "shardwise.optim",
    "shardwise.testing.models",
    "pytest",
]


def _start_context() -> SpawnContext | ForkServerContext:
    """``forkserver`` (a clean server process that imported torch once forks each rank), or ``spawn``
    when ``SHARDWISE_HARNESS_START=spawn`` (every rank imports torch itself)."""
    method = os.environ.get("SHARDWISE_HARNESS_START", "forkserver")
    if method == "spawn":
        return multiprocessing.get_context("spawn")
    if method != "forkserver":
        raise ValueError(
            f"SHARDWISE_HARNESS_START={method!r} is not a start method the harness uses; "
            "set 'forkserver' (the default) or 'spawn'"
        )
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _launch_once(
    payload: bytes,
    world_size: int,
    *,
    description: str,
    timeout: float,
    backend: str,
    env: dict[str, str] | None,
    collective_timeout: float,
) -> tuple[list[bytes] | None, DistributedTestError | None, bool]:
    """One spawn. Returns (results, error, port_in_use)."""
    ctx = _start_context()
    port = find_free_port()
    threads = max(1, _available_cpus() // world_size)
    tmpdir = tempfile.mkdtemp(prefix="shardwise-ranks-")
    states: list[_RankState] = []
    start = time.monotonic()
    deadline = start + timeout
    logger.debug("spawning %d %s ranks on %s:%d", world_size, backend, _LOOPBACK, port)
    try:
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            spec = RankSpec(
                rank=rank,
                world_size=world_size,
                payload=payload,
                backend=backend,
                collective_timeout_s=collective_timeout,
                num_threads=threads,
                env=_rank_env(rank, world_size, port, env, threads),
                stack_file=os.path.join(tmpdir, f"rank{rank}.stacks"),
            )
            # Not daemonic: daemonic processes may not start children (DataLoader workers).
            process = ctx.Process(target=worker_main, args=(spec, writer), name=f"shardwise-rank{rank}")
            process.start()
            writer.close()  # the child holds the only writer, so its exit shows up as EOF
            states.append(_RankState(rank=rank, process=process, reader=reader, stack_file=spec.stack_file))

        timed_out = False
        failed_since: float | None = None
        while True:
            # Exits first: a rank that crashes makes its peers fail with "Connection closed
            # by peer" right after, and the crash should be listed as the first failure.
            for state in states:
                _poll_exit(state)
            for state in states:
                _drain(state)
            now = time.monotonic()
            if failed_since is None and any(s.error is not None or s.died for s in states):
                failed_since = now
            if all(s.exited for s in states):
                break
            if failed_since is not None and now - failed_since >= _FAILURE_GRACE_S:
                break
            if now >= deadline:
                timed_out = failed_since is None
                break
            # Wait on the pipes as well as the exits: a child blocks in send() until the
            # parent reads, so a large result must be read while waiting, not after join.
            waitables: list[Any] = [s.reader for s in states if s.reader is not None]
            waitables += [s.process.sentinel for s in states if not s.exited]
            limit = deadline if failed_since is None else min(deadline, failed_since + _FAILURE_GRACE_S)
            wait(waitables, timeout=max(0.0, limit - now))

        elapsed = time.monotonic() - start
        if not timed_out and all(s.exited and s.result is not None and s.exit_code == 0 for s in states):
            return [s.result for s in states if s.result is not None], None, False

        # On a timeout a rank that returned but never exited is stuck too (in teardown).
        unfinished = [
            s.rank for s in states if not s.exited and s.error is None and (s.result is None or timed_out)
        ]
        stacks = _dump_stacks([s for s in states if s.rank in unfinished]) if timed_out else {}
        for state in states:
            _kill(state)
        for state in states:
            state.process.join(timeout=5.0)
            # Reports written completely before the kill are still in the pipe. Exit codes
            # are not re-read: after the kill they are the harness's doing, not the rank's.
            _drain(state)
        port_in_use = any(
            s.error is not None
            and s.error[0] == "process-group initialisation"
            and ("address already in use" in s.error[2].lower() or "eaddrinuse" in s.error[2].lower())
            for s in states
        )
        error = _format_failure(
            states, description, elapsed, timed_out=timed_out, stacks=stacks, unfinished=unfinished
        )
        return None, error, port_in_use
    finally:
        for state in states:
            _kill(state)
            state.process.join(timeout=5.0)
            if state.reader is not None:
                state.reader.close()
        shutil.rmtree(tmpdir, ignore_errors=True)


def _describe(fn: Callable[..., Any], world_size: int) -> str:
    name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
    return f"{world_size}-rank run of {name}"


def _spawn(
    fn: Callable[..., Any],
    fn_args: tuple[Any, ...],
    fn_kwargs: dict[str, Any],
    world_size: int,
    *,
    description: str,
    timeout: float,
    backend: str,
    env: dict[str, str] | None,
    collective_timeout: float | None,
) -> list[Any]:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} is invalid: it must be an int >= 1.")
    if timeout <= 0:
        raise ValueError(f"timeout={timeout!r} is invalid: it must be > 0 seconds.")
    if collective_timeout is None:
        # Half the budget: the rest covers start-up (a few seconds per rank to import
        # torch) and lets a gloo timeout error arrive before the harness gives up.
        collective_timeout = timeout / 2
    if not 0 < collective_timeout <= timeout:
        raise ValueError(
            f"collective_timeout={collective_timeout!r} is invalid: it must be > 0 and at most "
            f"timeout={timeout!r}, so that collective errors arrive before the harness kills the ranks."
        )
    if env is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise ValueError(f"env={env!r} is invalid: keys and values must be str.")
    try:
        payload = pickle.dumps((fn, fn_args, fn_kwargs), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise ValueError(
            f"{description}: the function and its arguments must be picklable ({exc}). Define the "
            "function at module level (not a lambda or a function nested in a test) and pass "
            "picklable args/kwargs."
        ) from exc

    # Rank 0 binds the port seconds after find_free_port released it; if something took
    # it meanwhile, the run failed before any user code ran, so one retry is safe.
    for attempt in range(2):
        results, error, port_in_use = _launch_once(
            payload,
            world_size,
            description=description,
            timeout=timeout,
            backend=backend,
            env=env,
            collective_timeout=collective_timeout,
        )
        if error is None:
            assert results is not None
            return [pickle.loads(data) for data in results]
        if not (port_in_use and attempt == 0):
            raise error
        logger.warning("%s: the rendezvous port was taken; retrying on a new port", description)
    raise AssertionError("unreachable")


def run_distributed(
    fn: Callable[..., Any],
    world_size: int = 2,
    *,
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    timeout: float = 120.0,
    backend: str = "gloo",
    env: dict[str, str] | None = None,
    collective_timeout: float | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` spawned ranks.

    Each rank is a fresh process (see the module docstring) with ``MASTER_ADDR=127.0.0.1``, a free
    ``MASTER_PORT``, ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``/``LOCAL_WORLD_SIZE`` set, torch
    limited to ``max(1, cpus // world_size)`` threads and the default process group
    initialised; the group is destroyed after ``fn`` returns.

    Args:
        fn: a module-level (picklable) function; receives the rank and world size first.
        world_size: number of ranks to spawn.
        args: extra positional arguments for ``fn`` (picklable).
        kwargs: extra keyword arguments for ``fn`` (picklable).
        timeout: seconds for the whole run, start-up included; then every rank is killed.
        backend: ``torch.distributed`` backend (``"gloo"`` for CPU tests).
        env: extra environment variables for every rank, set before torch is imported.
        collective_timeout: the process group's timeout in seconds; defaults to
            ``timeout / 2`` and must not exceed ``timeout``.

    Returns:
        The return values of ``fn``, indexed by rank.

    Raises:
        DistributedTestError: a rank raised (its traceback is in the message), died
            (its exit code is), or the run timed out (the unfinished ranks are named).
        ValueError: invalid arguments, or ``fn``/its arguments cannot be pickled.

    Example:
        >>> # in a test module:
        >>> def _sum_ranks(rank, world_size):
        ...     import torch, torch.distributed as dist
        ...     t = torch.tensor([float(rank)])
        ...     dist.all_reduce(t)
        ...     return t.item()
        >>> # run_distributed(_sum_ranks, world_size=2)
        >>> # -> [1.0, 1.0]
    """
    return _spawn(
        fn,
        tuple(args),
        dict(kwargs or {}),
        world_size,
        description=_describe(fn, world_size),
        timeout=timeout,
        backend=backend,
        env=env,
        collective_timeout=collective_timeout,
    )


def run_distributed_cases(
    fn: Callable[..., Any],
    cases: Sequence[Any],
    world_size: int = 2,
    *,
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    timeout: float = 120.0,
    backend: str = "gloo",
    env: dict[str, str] | None = None,
    collective_timeout: float | None = None,
) -> list[list[Any]]:
    """Run ``fn(rank, world_size, case, *args, **kwargs)`` for every case in one spawn.

    Spawning costs seconds, so parametrised distributed checks should share one set of
    ranks: the cases run one after another on the same process group, in order. If a case
    raises on any rank the run stops, and the error names the case; on a timeout the
    error says which case each unfinished rank had reached.

    Args:
        fn: a module-level (picklable) function taking ``(rank, world_size, case)``.
        cases: picklable case descriptions (dicts, tuples, dataclasses...).
        world_size: number of ranks to spawn.
        args: extra positional arguments for ``fn`` after the case.
        kwargs: extra keyword arguments for ``fn``.
        timeout: seconds for the whole grid, start-up included.
        backend: ``torch.distributed`` backend.
        env: extra environment variables for every rank.
        collective_timeout: the process group's timeout; defaults to ``timeout / 2``.

    Returns:
        ``results[case_index][rank]``: what ``fn`` returned for each case on each rank.

    Raises:
        DistributedTestError: as for :func:`run_distributed`, naming the failing case.
        ValueError: invalid arguments, or something cannot be pickled.

    Example:
        >>> def _scaled_sum(rank, world_size, case):  # in a test module
        ...     import torch, torch.distributed as dist
        ...     t = torch.tensor([float(rank) * case["scale"]])
        ...     dist.all_reduce(t)
        ...     return t.item()
        >>> # run_distributed_cases(_scaled_sum, [{"scale": 1}, {"scale": 10}])
        >>> # -> [[1.0, 1.0], [10.0, 10.0]]
    """
    cases = list(cases)
    if not cases:
        return []
    per_rank = _spawn(
        run_cases,
        (fn, cases, tuple(args), dict(kwargs or {})),
        {},
        world_size,
        description=f"{_describe(fn, world_size)} over {len(cases)} cases",
        timeout=timeout,
        backend=backend,
        env=env,
        collective_timeout=collective_timeout,
    )
    return [[per_rank[rank][index] for rank in range(world_size)] for index in range(len(cases))]
