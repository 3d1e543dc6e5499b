"""Runners: turn a :class:`~shardwise.launcher.planner.LaunchPlan` into processes.

Two halves:

* :func:`build_commands` is pure: the exact command lines for each backend (what
  ``--dry_run`` prints and the unit tests check).

  ============  ===========================================================================
  ``local``     one torchrun agent per node, all on this machine (one node normally; several
                for ``--launcher local`` tests of multi-node launches on 127.0.0.1)
  ``ssh``       ``ssh host "export ...; cd CWD; <that node's torchrun>"`` per node
  ``pdsh``      ``pdsh -S -f 1024 -w h1,h2 "export ...; cd CWD; python -u -m
                shardwise.launcher.node --node_rank=%n ..."`` (one line for all nodes)
  ``openmpi``   ``mpirun -n N -hostfile F --mca btl ^openib ... -x K=V python -u -m
                shardwise.launcher.worker -- script args``: mpirun starts every rank
  ``mpich``,    ``mpirun -n N -ppn P -hosts h1,h2 -genv K V ...`` (impi adds ``I_MPI_PIN 0``)
  ``impi``
  ``mvapich``   ``mpirun -np N -ppn P --hostfile /tmp/shardwise_mvapich_hostfile`` with
                DeepSpeed's ``MV2_*`` settings
  ``slurm``     ``srun -n N [--nodelist ...] --kill-on-bad-exit=1 --export=ALL,K=V python
                -u -m shardwise.launcher.worker -- script args``
  ============  ===========================================================================

  With the MPI and SLURM backends the MPI launcher or srun is the process manager (it
  starts and stops every rank); the worker reads the rank layout from their variables.

* :func:`run_commands` starts them, forwards Ctrl-C/SIGTERM, stops every node when one
  fails (torchrun's agents stop their own node's ranks, but a static-rendezvous agent on
  another node would otherwise wait for the collective timeout), and returns the exit codes.
  What it starts gets SIGTERM when the launcher dies, even by SIGKILL: a local agent stops
  its ranks, mpirun and srun stop theirs; ssh and pdsh end, and the remote agents stop when
  their remote shell ends (a remote shell that outlives a dropped connection keeps them).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import FrameType

from shardwise.launcher.lifeline import preexec_die_with
from shardwise.launcher.planner import DEFAULT_HOSTFILE, LOCAL, LaunchPlan
from shardwise.launcher.torchrun_command import agent_restarts, rdzv_id, worker_args
from shardwise.utils.logging import logger

__all__ = ["MVAPICH_HOSTFILE", "RunnerCommand", "build_commands", "check_backend", "run_commands"]

MVAPICH_HOSTFILE = "/tmp/shardwise_mvapich_hostfile"
_MVAPICH_ENV = {
    "MV2_SMP_USE_CMA": "0",
    "MV2_DEBUG_SHOW_BACKTRACE": "1",
    "MV2_USE_CUDA": "1",
    "MV2_SUPPORT_DL": "1",
    "MV2_ENABLE_AFFINITY": "0",
    "MV2_INTER_ALLGATHER_TUNING": "5",
    "MV2_CUDA_USE_NAIVE": "0",
}
_BINARIES = {"pdsh": "pdsh", "ssh": "ssh", "openmpi": "mpirun", "mpich": "mpirun", "impi": "mpirun"}
_BINARIES.update({"mvapich": "mpirun", "slurm": "srun"})
# How long stopped agents get to stop their ranks (torchrun waits 30 s before SIGKILL).
_STOP_GRACE_S = 40.0


@dataclass(frozen=True)
class RunnerCommand:
    """One process the launcher starts on this machine.

    Attributes:
        label: what it runs, for logs (``node 0 (localhost)``, ``all nodes``).
        argv: the command.
        env: variables added to this machine's environment for it.
        files: files to write before starting it (``{path: text}``).
    """

    label: str
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)

    def display(self) -> str:
        """A copy-pasteable shell line (variables first)."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return (env + " " if env else "") + shlex.join(self.argv)


def _launcher_args(plan: LaunchPlan) -> list[str]:
    return shlex.split(plan.options.launcher_args) if plan.options.launcher_args else []


def _rank_program(plan: LaunchPlan) -> list[str]:
    """What an MPI/SLURM-started rank runs: the worker wrapping the script."""
    return [plan.options.python, "-u", *worker_args(plan.options)]


def _mpi_exports(plan: LaunchPlan) -> dict[str, str]:
    exports = {k: v for k, v in plan.exports.items() if k != "CUDA_VISIBLE_DEVICES"}
    exports["MASTER_ADDR"] = plan.master_addr
    exports["MASTER_PORT"] = str(plan.master_port)
    return exports


def _remote_line(env: Mapping[str, str], venv_script: str | None, cwd: str, argv: Sequence[str]) -> str:
    """``export K=V; ...; [source VENV;] cd CWD; command`` for a remote shell."""
    parts = [f"export {k}={shlex.quote(v)};" for k, v in env.items()]
    if venv_script:
        parts.append(f"source {shlex.quote(venv_script)};")
    parts.append(f"cd {shlex.quote(cwd)};")
    parts.append(shlex.join(argv))
    return " ".join(parts)


def _uniform_slots(plan: LaunchPlan, backend: str) -> int:
    counts = {len(slots) for slots in plan.resources.values()}
    if len(counts) != 1:
        raise ValueError(
            f"--launcher {backend} places the same number of processes on every node, but the selected hosts have "
            f"{ {h: len(s) for h, s in plan.resources.items()} } slots. Use equal slot counts or --launcher pdsh."
        )
    return counts.pop()


def build_commands(plan: LaunchPlan, cwd: str) -> list[RunnerCommand]:
    """The processes this machine starts for ``plan`` (pure; ``--dry_run`` prints them).

    Raises:
        ValueError: the backend cannot express the plan (srun with specific device ids or
            unequal slot counts, MPI backends with unequal slots where ``-ppn`` is needed).

    Example:
        >>> from shardwise.launcher.planner import LaunchOptions, plan_launch
        >>> plan = plan_launch(LaunchOptions("t.py", python="python"), pool={"a": 1, "b": 1},
        ...                    device_count=0, environ={}, cwd="/w")
        >>> build_commands(plan, "/w")[0].argv[:6]
        ('pdsh', '-S', '-f', '1024', '-w', 'a,b')
    """
    runner = plan.runner
    extra = _launcher_args(plan)
    if runner == LOCAL:
        return [
            RunnerCommand(f"node {n.node.node_rank} ({n.node.host})", n.argv, dict(n.env)) for n in plan.nodes
        ]
    if runner == "ssh":
        port = ["-p", str(plan.options.ssh_port)] if plan.options.ssh_port else []
        commands = []
        for n in plan.nodes:
            remote = _remote_line(n.env, plan.options.venv_script, cwd, n.argv)
            commands.append(
                RunnerCommand(
                    f"node {n.node.node_rank} ({n.node.host})", ("ssh", *port, *extra, n.node.host, remote)
                )
            )
        return commands
    if runner == "pdsh":
        options = plan.options
        node_entry = [
            options.python,
            "-u",
            "-m",
            "shardwise.launcher.node",
            f"--world_info={plan.world_info}",
            "--node_rank=%n",
            f"--master_addr={plan.master_addr}",
            f"--master_port={plan.master_port}",
            f"--rendezvous={plan.rendezvous}",
            f"--nnodes={plan.nnodes}",
            f"--rdzv_id={rdzv_id(options)}",
            f"--max_restarts={agent_restarts(options, plan.rendezvous, plan.nnodes)}",
            *([f"--log_dir={options.each_rank_log}"] if options.each_rank_log else []),
            "--",
            *worker_args(options),
        ]
        # CUDA_VISIBLE_DEVICES differs per node: the node entry sets it from the world info.
        remote = _remote_line(plan.exports, options.venv_script, cwd, node_entry)
        hosts = ",".join(n.node.host for n in plan.nodes)
        pdsh = ("pdsh", "-S", "-f", "1024", "-w", hosts, *extra, remote)
        return [RunnerCommand("all nodes", pdsh, {"PDSH_RCMD_TYPE": "ssh"})]
    exports = _mpi_exports(plan)
    world = str(plan.world_size)
    argv: list[str]
    if runner == "openmpi":
        argv = ["mpirun", "-n", world, "-hostfile", plan.options.hostfile or DEFAULT_HOSTFILE]
        argv += ["--mca", "btl", "^openib"]
        if not any("btl_tcp_if_include" in a for a in extra):
            argv += ["--mca", "btl_tcp_if_include", "eth0"]
        exports["UCX_TLS"] = "tcp"
        argv += extra
        for key, value in exports.items():
            argv += ["-x", f"{key}={value}"]
        return [RunnerCommand("all ranks", (*argv, *_rank_program(plan)))]
    if runner in ("mpich", "impi", "mvapich"):
        ppn = str(_uniform_slots(plan, runner))
        files: dict[str, str] = {}
        if runner == "mvapich":
            exports.update(_MVAPICH_ENV)
            files[MVAPICH_HOSTFILE] = "".join(f"{n.node.host}\n" for n in plan.nodes)
            argv = ["mpirun", "-np", world, "-ppn", ppn, "--hostfile", MVAPICH_HOSTFILE]
        else:
            hosts = ",".join(n.node.host for n in plan.nodes)
            argv = ["mpirun", "-n", world, "-ppn", ppn, "-hosts", hosts]
            if runner == "impi":
                argv += ["-genv", "I_MPI_PIN", "0"]
        argv += extra
        for key, value in exports.items():
            argv += ["-genv", key, value]
        return [RunnerCommand("all ranks", (*argv, *_rank_program(plan)), files=files)]
    if runner == "slurm":
        per_node = _uniform_slots(plan, runner)
        if any(slots != list(range(len(slots))) for slots in plan.resources.values()):
            raise ValueError(
                "--launcher slurm cannot select specific device ids (srun gives each node its first GPUs); use "
                "--num_gpus, or --launcher pdsh for --include/--exclude with slot lists."
            )
        argv = ["srun", "-n", world, *extra]
        options = plan.options
        if options.include or options.exclude:
            argv += ["--nodelist", ",".join(plan.resources), "--nodes", str(len(plan.resources))]
        elif options.num_nodes > 0:
            argv += ["--nodes", str(options.num_nodes)]
        if options.num_gpus > 0:
            argv += ["--gpus-per-node", str(per_node)]
        if not any(a == "-K" or a.startswith(("--kill-on-bad-exit", "-K")) for a in extra):
            # A failed rank ends the step at once (as the other runners stop every node), not
            # when the others time out: the cluster's default KillOnBadExit=0 lets them run on.
            argv.append("--kill-on-bad-exit=1")
        argv.append("--export=ALL," + ",".join(f"{k}={v}" for k, v in exports.items()))
        return [RunnerCommand("all ranks", (*argv, *_rank_program(plan)))]
    raise ValueError(f"unknown runner {runner!r}")  # plan_launch validated it already


def check_backend(plan: LaunchPlan, ssh_check: bool = True) -> None:
    """Fail early when the backend's program is missing or passwordless ssh does not work.

    Raises:
        RuntimeError: with the missing program or the failed ssh check, and what to do.
    """
    binary = _BINARIES.get(plan.runner)
    if binary is None:
        return
    if shutil.which(binary) is None:
        raise RuntimeError(
            f"launcher '{plan.runner}' not installed: '{binary}' is not on PATH. Install it, pick another "
            "--launcher, or use --dry_run to see the commands."
        )
    if ssh_check and plan.runner in ("pdsh", "ssh"):
        first = plan.nodes[0].node.host
        port = ["-p", str(plan.options.ssh_port)] if plan.options.ssh_port else []
        result = subprocess.run(
            ["ssh", *port, "-o", "PasswordAuthentication=no", "-o", "BatchMode=yes", first, "hostname"],
            capture_output=True,
            timeout=60,
            check=False,
        )
        if result.returncode != 0:
            raise RuntimeError(
                f"Using hostfile hosts requires passwordless ssh to each host, and 'ssh {first} hostname' failed "
                f"({result.stderr.decode(errors='replace').strip()}). Set up ssh keys, pass --no_ssh_check to skip "
                "this check, or remove the hostfile to run on this machine only."
            )


def _terminate(process: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> None:
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):  # it exited meanwhile
            os.killpg(process.pid, sig)


def run_commands(
    commands: Sequence[RunnerCommand],
    base_env: Mapping[str, str],
    *,
    stop_grace: float = _STOP_GRACE_S,
    stop_on_failure: bool = True,
) -> tuple[dict[str, int], int | None]:
    """Start every command, wait, stop all when one fails; forward SIGINT/SIGTERM.

    Each command runs in its own session (process group), so stopping it reaches every
    process it started, and gets SIGTERM when this process dies, however it dies
    (:mod:`shardwise.launcher.lifeline`). Output goes straight to this process's stdout/stderr.
    ``stop_on_failure=False`` (elastic runs) lets the other nodes carry on without the
    failed one: their agents re-rendezvous with fewer nodes.

    Returns:
        ``({label: exit code}, signal received or None)``.
    """
    for command in commands:
        for path, text in command.files.items():
            with open(path, "w", encoding="utf-8") as handle:
                handle.write(text)
    processes: dict[str, subprocess.Popen[bytes]] = {}
    received: list[int] = []

    def forward(signum: int, _frame: FrameType | None) -> None:
        received.append(signum)
        for process in processes.values():
            _terminate(process, signal.SIGTERM)

    # Each command gets SIGTERM if this process dies, even by SIGKILL (see lifeline).
    die_with_launcher = preexec_die_with(os.getpid(), signal.SIGTERM)
    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for command in commands:
            env = dict(base_env)
            env.update(command.env)
            logger.info("starting %s: %s", command.label, command.display())
            processes[command.label] = subprocess.Popen(
                list(command.argv), env=env, start_new_session=True, preexec_fn=die_with_launcher
            )
        stop_deadline: float | None = None
        while True:
            codes = {label: p.poll() for label, p in processes.items()}
            running = [label for label, code in codes.items() if code is None]
            if not running:
                break
            failed = (
                [label for label, code in codes.items() if code not in (None, 0)] if stop_on_failure else []
            )
            if (failed or received) and stop_deadline is None:
                if failed:
                    logger.info(
                        "%s failed (exit code %s); stopping %s",
                        failed[0],
                        codes[failed[0]],
                        ", ".join(running),
                    )
                for label in running:
                    _terminate(processes[label], signal.SIGTERM)
                stop_deadline = time.monotonic() + stop_grace
            if stop_deadline is not None and time.monotonic() > stop_deadline:
                for label in running:
                    _terminate(processes[label], signal.SIGKILL)
                stop_deadline = float("inf")
            time.sleep(0.05)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for process in processes.values():  # never leave a node running behind us
            _terminate(process, signal.SIGKILL)
            process.wait()
    return {label: int(p.returncode) for label, p in processes.items()}, (received[0] if received else None)
