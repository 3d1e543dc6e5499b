"""What every rank runs: DeepSpeed's per-process contract, then the user's script.

torchrun starts ``python -m shardwise.launcher.worker [flags] -- script.py args`` once per
local process. The worker, in this order:

1. under ``shardwise``'s agent, ties itself to it: the rank gets SIGKILL if the agent dies
   (:mod:`shardwise.launcher.lifeline`), so no rank outlives its launcher;
2. completes the environment DeepSpeed scripts expect: ``LOCAL_SIZE``, ``CROSS_RANK`` and
   ``CROSS_SIZE`` next to torchrun's ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``/``MASTER_*``;
   under mpirun or srun (no torchrun) all of them, from the MPI/SLURM variables;
3. with ``--bind_cores_to_rank``, pins the process to its share of the cores
   (``sched_setaffinity``, no numactl needed) and sets ``OMP_NUM_THREADS`` to match;
4. arranges for a stack dump into the run directory if a signal stops it, so the launcher
   can say where a stopped rank was;
5. runs the script as ``python script.py --local_rank=N args`` would (``--local_rank`` is
   inserted before the user's arguments unless ``--no_local_rank``), in this process, so
   an exception is caught: it is written to torchrun's error file and to a failure record
   (with the hang diagnosis when a collective failed), and the exit code is kept.

The environment and core-binding rules are pure functions, tested without processes. This
module imports neither torch nor the user's packages before the script runs, so variables
such as ``OMP_NUM_THREADS`` still take effect.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import runpy
import signal
import socket
import sys
import time
import traceback
from collections.abc import Mapping, Sequence
from typing import TextIO

from shardwise.comm.diagnostics import short_error
from shardwise.launcher.failures import RUN_DIR_VAR, write_record
from shardwise.launcher.lifeline import AGENT_PID_VAR, die_with_parent

__all__ = ["cores_for_rank", "main", "parse_core_list", "script_argv", "worker_environment"]


def worker_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables to add for the script: DeepSpeed's names next to torchrun's.

    Under torchrun: ``LOCAL_SIZE`` (= ``LOCAL_WORLD_SIZE``), ``CROSS_RANK`` (= the node's
    ``GROUP_RANK``) and ``CROSS_SIZE`` (= ``GROUP_WORLD_SIZE``). Under mpirun/srun: also
    ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` and ``MASTER_*``, read from
    the MPI/SLURM variables; the node index is ``RANK // LOCAL_SIZE`` (those launchers place
    the same number of ranks on every node here). Alone: a world of one.

    Raises:
        ValueError: inconsistent launcher variables (from the environment discovery).

    Example:
        >>> env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
        ...        "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "x"}
        >>> worker_environment(env)
        {'LOCAL_SIZE': '2', 'CROSS_RANK': '1', 'CROSS_SIZE': '2'}
        >>> worker_environment({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
        ...     "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        ...     "MASTER_ADDR": "h0", "MASTER_PORT": "29500"})["CROSS_RANK"]
        '1'
    """
    if environ.get("TORCHELASTIC_RUN_ID") and environ.get("LOCAL_RANK", "").strip():
        out = {"LOCAL_SIZE": environ.get("LOCAL_WORLD_SIZE", "1")}
        if environ.get("GROUP_RANK", "").strip():
            out["CROSS_RANK"] = environ["GROUP_RANK"]
        if environ.get("GROUP_WORLD_SIZE", "").strip():
            out["CROSS_SIZE"] = environ["GROUP_WORLD_SIZE"]
        return out
    from shardwise.comm.env import discover_environment

    found = discover_environment(environ, default_port=29500, require_master=False)
    if found is None:
        return {
            "RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "1",
            "LOCAL_SIZE": "1",
            "CROSS_RANK": "0",
            "CROSS_SIZE": "1",
        }
    out = found.torch_env()
    local_size = found.local_world_size or 1
    out["LOCAL_WORLD_SIZE"] = out["LOCAL_SIZE"] = str(local_size)
    out["CROSS_RANK"] = str(found.rank // local_size)
    out["CROSS_SIZE"] = str(-(-found.world_size // local_size))
    return out


def parse_core_list(text: str) -> list[int]:
    """Parse ``--bind_core_list`` (``"0,2-5,8"``) into core ids, in order, without duplicates.

    Raises:
        ValueError: a part is not a number or an ``a-b`` range with ``a <= b``.

    Example:
        >>> parse_core_list("1,3-5,7")
        [1, 3, 4, 5, 7]
    """
    cores: list[int] = []
    for part in text.split(","):
        part = part.strip()
        low, sep, high = part.partition("-")
        if low.isdigit() and (not sep or (high.isdigit() and int(low) <= int(high))):
            for core in range(int(low), int(high if sep else low) + 1):
                if core not in cores:
                    cores.append(core)
            continue
        raise ValueError(f"--bind_core_list {text!r}: {part!r} is not a core id or a range like 2-5.")
    return cores


def cores_for_rank(cores: Sequence[int], local_rank: int, local_size: int) -> list[int]:
    """This rank's equal, contiguous share of ``cores`` (the remainder stays unused).

    Raises:
        ValueError: fewer cores than local processes.

    Example:
        >>> cores_for_rank(range(8), 1, 3)
        [2, 3]
    """
    cores = list(cores)
    per_rank = len(cores) // max(local_size, 1)
    if per_rank == 0:
        raise ValueError(
            f"--bind_cores_to_rank: {len(cores)} core(s) cannot be shared by {local_size} processes on this node; "
            "launch fewer processes per node or give more cores with --bind_core_list."
        )
    return cores[local_rank * per_rank : (local_rank + 1) * per_rank]


def script_argv(script: str, args: Sequence[str], local_rank: int, no_local_rank: bool) -> list[str]:
    """``sys.argv`` for the script: ``--local_rank=N`` goes before the user's arguments.

    Example:
        >>> script_argv("train.py", ["--lr", "1"], 1, False)
        ['train.py', '--local_rank=1', '--lr', '1']
    """
    return [script, *([] if no_local_rank else [f"--local_rank={local_rank}"]), *args]


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m shardwise.launcher.worker")
    parser.add_argument("--no_local_rank", action="store_true")
    parser.add_argument("--module", action="store_true")
    parser.add_argument("--no_python", action="store_true")
    parser.add_argument("--bind_cores_to_rank", action="store_true")
    parser.add_argument("--bind_core_list", default=None)
    parser.add_argument("script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)
    argv = list(argv)
    if "--" in argv:  # everything after "--" belongs to the script, even flags we also know
        cut = argv.index("--")
        args = parser.parse_args([*argv[:cut], argv[cut + 1]])
        args.script_args = argv[cut + 2 :]
        return args
    return parser.parse_args(argv)


def _bind_cores(opts: argparse.Namespace, environ: dict[str, str] | os._Environ[str]) -> None:
    if not (opts.bind_cores_to_rank or opts.bind_core_list):
        return
    if environ.get("KMP_AFFINITY"):
        raise ValueError(
            "--bind_cores_to_rank conflicts with KMP_AFFINITY (both pin threads to cores); unset KMP_AFFINITY."
        )
    available = (
        parse_core_list(opts.bind_core_list) if opts.bind_core_list else sorted(os.sched_getaffinity(0))
    )
    mine = cores_for_rank(available, int(environ.get("LOCAL_RANK", "0")), int(environ.get("LOCAL_SIZE", "1")))
    os.sched_setaffinity(0, mine)
    environ["OMP_NUM_THREADS"] = str(len(mine))


def _user_traceback(exc: BaseException) -> str:
    """The traceback without this module's and runpy's frames."""
    tb = exc.__traceback__
    skip = {os.path.abspath(__file__), os.path.abspath(runpy.__file__)}

    def ours(filename: str) -> bool:
        return filename.startswith("<frozen runpy") or os.path.abspath(filename) in skip

    while tb is not None and ours(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _diagnose(exc: BaseException) -> str | None:
    if "torch.distributed" not in sys.modules:
        return None  # the script never used a process group
    try:
        from shardwise.comm.diagnostics import diagnose_exception

        return diagnose_exception(exc)
    except Exception as diag_error:  # a diagnosis must never hide the original error
        return f"(hang diagnosis failed: {type(diag_error).__name__}: {diag_error})"


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    return 1  # sys.exit("message") prints the message and exits with 1


def _record(exitcode: int, exc: BaseException | None, tb_text: str, diagnosis: str | None) -> None:
    if exc is not None:
        error = f"{type(exc).__name__}: {short_error(str(exc))}".rstrip(": ")
    else:
        error = f"exited with code {exitcode}"
    now = time.time()
    data: dict[str, object] = {
        "rank": int(os.environ.get("RANK", "0") or 0),
        "local_rank": int(os.environ.get("LOCAL_RANK", "0") or 0),
        "node_rank": int(os.environ.get("CROSS_RANK", "0") or 0),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "exitcode": exitcode,
        "time": now,
        "error": error[:500],
        "traceback": tb_text,
        "diagnosis": diagnosis,
    }
    run_dir = os.environ.get(RUN_DIR_VAR, "")
    if run_dir:
        with contextlib.suppress(OSError):  # then the summary falls back to the agents' exit codes
            write_record(run_dir, data)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE", "")
    if error_file and exc is not None:
        # torchrun's own format, so its failure summary shows the traceback too.
        message = error if not diagnosis else f"{error}\n{diagnosis}"
        payload = {
            "message": {
                "message": message,
                "extraInfo": {"py_callstack": tb_text, "timestamp": str(int(now))},
            }
        }
        try:
            with open(error_file, "w", encoding="utf-8") as handle:
                json.dump(payload, handle)
        except OSError:
            pass


def _dump_stack_on_signal() -> TextIO | None:
    """Register a stack dump into the run directory for SIGTERM (how torchrun stops ranks)."""
    run_dir = os.environ.get(RUN_DIR_VAR, "")
    if not run_dir or not hasattr(faulthandler, "register"):
        return None
    try:
        os.makedirs(run_dir, exist_ok=True)
        handle = open(os.path.join(run_dir, f"rank-{os.environ.get('RANK', '0')}.stack"), "w")  # noqa: SIM115
        # chain=True: after the dump the default action (terminate) still happens.
        faulthandler.register(signal.SIGTERM, file=handle, all_threads=True, chain=True)
        return handle
    except (OSError, RuntimeError, ValueError):
        return None


def _run_script(opts: argparse.Namespace, argv: list[str]) -> None:
    if opts.no_python:
        os.execvp(argv[0], argv)
    sys.argv = argv
    if opts.module:
        runpy.run_module(opts.script, run_name="__main__", alter_sys=True)
        return
    # `python script.py` puts the script's directory first on sys.path (not the cwd).
    sys.path[0] = os.path.dirname(os.path.abspath(opts.script))
    runpy.run_path(opts.script, run_name="__main__")


def _die_with_agent(environ: dict[str, str] | os._Environ[str]) -> None:
    """Tie this rank to its torchrun agent (see :mod:`shardwise.launcher.lifeline`).

    Only when the agent is ``shardwise.launcher.agent`` (it announced its pid); the variable
    is removed so that programs the script starts do not tie themselves to it.
    """
    agent_pid = environ.pop(AGENT_PID_VAR, "")
    if agent_pid.isdigit() and environ.get("TORCHELASTIC_RUN_ID"):
        die_with_parent(signal.SIGKILL, int(agent_pid))


def main(argv: Sequence[str] | None = None) -> int:
    """Run one rank: tie it to its agent, environment, core binding, the script; returns its exit code."""
    _die_with_agent(os.environ)
    opts = _parse(sys.argv[1:] if argv is None else argv)
    os.environ.update(worker_environment(os.environ))
    _bind_cores(opts, os.environ)
    stack_file = _dump_stack_on_signal()
    local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
    try:
        _run_script(opts, script_argv(opts.script, opts.script_args, local_rank, opts.no_local_rank))
    except SystemExit as exit_:
        code = _exit_code(exit_.code)
        if code != 0:
            _record(code, None, "", None)
        raise
    except BaseException as exc:  # every failure is recorded, then reported as Python would
        code = 130 if isinstance(exc, KeyboardInterrupt) else 1
        # Diagnose first: it marks this rank as failed where the other ranks look, and
        # formatting the traceback reads source files, which is slow on a loaded machine.
        diagnosis = _diagnose(exc)
        tb_text = _user_traceback(exc)
        _record(code, exc, tb_text, diagnosis)
        sys.stderr.write(tb_text)
        if diagnosis:
            sys.stderr.write(
                f"[shardwise] hang diagnosis (rank {os.environ.get('RANK', '0')}):\n{diagnosis}\n"
            )
        sys.stderr.flush()
        return code
    finally:
        if stack_file is not None:
            faulthandler.unregister(signal.SIGTERM)
            stack_file.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
