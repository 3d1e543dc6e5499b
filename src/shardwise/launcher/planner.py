"""Launch planning: from command-line options and a hostfile to every node's exact command.

Pure functions over plain data (the options, the parsed hostfile, the environment, the
device count), so every decision the launcher makes is testable in microseconds and shown
by ``--dry_run``. Nothing here starts a process; the runners in
:mod:`shardwise.launcher.runners` take a :class:`LaunchPlan` and do only that.

What a plan decides:

* **Resources** (spec 9.2): ``{host: [slots]}`` from the hostfile (default ``/job/hostfile``,
  missing is fine) or, without one, this machine: its GPUs, or ``--num_gpus`` CPU processes
  when it has none. ``CUDA_VISIBLE_DEVICES`` becomes ``--include localhost:<ids>`` when no
  filter was given. The ``local`` launcher may simulate ``--num_nodes`` nodes on this
  machine (hosts ``local-0``, ``local-1``, ...), which is how multi-node launches are tested.
* **Runner**: one host and no ``--force_multi`` (or ``--no_ssh``) runs locally; more hosts
  use ``--launcher`` (pdsh by default, as in DeepSpeed).
* **Rendezvous**: a fixed-size run uses torchrun's *static* rendezvous with
  ``--node-rank`` = the host's position in the hostfile, so global ranks follow hostfile
  order (DeepSpeed's rule: rank 0 is on the first host). ``--elastic_training`` uses the
  *c10d* rendezvous with ``--nnodes=min:max``, where node ranks are assigned at every
  (re)join; ``--rdzv_backend c10d`` selects it for a fixed-size run too.
* **Per-node command**: ``python -u -m shardwise.launcher.agent ... -m
  shardwise.launcher.worker [flags] -- script args`` (torchrun, tied to the launcher); the
  worker adds ``--local_rank`` and DeepSpeed's ``LOCAL_SIZE``/``CROSS_RANK``/``CROSS_SIZE``.
* **Exports**: ``.deepspeed_env`` / ``.shardwise_env`` (home, then the working directory;
  ``DS_ENV_FILE`` renames the DeepSpeed one) on every node, plus, for remote nodes, the
  variables DeepSpeed forwards (prefixes ``NCCL``, ``PYTHON``, ``MLFLOW``, ``MV2``, ``UCX``)
  and ours (``SHARDWISE``, ``TORCH_``, ``DEEPSPEED_TIMEOUT``).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from shardwise.launcher.exports import collect_exports
from shardwise.launcher.hostfile import read_hostfile
from shardwise.launcher.resources import (
    NodePlan,
    assign_ranks,
    encode_world_info,
    include_from_visible_devices,
    select_resources,
)
from shardwise.launcher.torchrun_command import endpoint, torchrun_args

__all__ = [
    "DEFAULT_HOSTFILE",
    "LAUNCHERS",
    "LaunchOptions",
    "LaunchPlan",
    "NodeLaunch",
    "describe_plan",
    "find_deepspeed_config",
    "load_pool",
    "plan_launch",
    "resolve_resources",
]

DEFAULT_HOSTFILE = "/job/hostfile"
LOCAL = "local"
LAUNCHERS = ("pdsh", "ssh", "openmpi", "mpich", "impi", "mvapich", "slurm", LOCAL)
"""Every ``--launcher`` value; ``local`` runs all nodes on this machine."""

_BINARIES_OF = {"openmpi": "mpirun", "mpich": "mpirun", "impi": "mpirun", "mvapich": "mpirun", "slurm": "srun"}
_LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})


@dataclass(frozen=True)
class LaunchOptions:
    """What the user asked for: DeepSpeed's launcher options (spec 9.1) plus a few of ours.

    Attributes mirror the command-line flags of the same name; ``hostfile=None`` means
    DeepSpeed's default ``/job/hostfile``, which may be missing (then only this machine is
    used), while an explicitly named hostfile must exist.
    """

    user_script: str
    user_args: tuple[str, ...] = ()
    hostfile: str | None = None
    include: str = ""
    exclude: str = ""
    num_nodes: int = -1
    num_gpus: int = -1
    master_addr: str = ""
    master_port: int = 29500
    launcher: str = "pdsh"
    launcher_args: str = ""
    force_multi: bool = False
    no_local_rank: bool = False
    module: bool = False
    no_python: bool = False
    no_ssh: bool = False
    node_rank: int = -1
    bind_cores_to_rank: bool = False
    bind_core_list: str | None = None
    elastic_training: bool = False
    min_elastic_nodes: int = -1
    max_elastic_nodes: int = -1
    max_restarts: int | None = None
    rdzv_backend: str | None = None
    rdzv_id: str | None = None
    each_rank_log: str | None = None
    ssh_port: int | None = None
    venv_script: str | None = None
    python: str = field(default_factory=lambda: sys.executable)


@dataclass(frozen=True)
class NodeLaunch:
    """One node's part of a launch.

    Attributes:
        node: the node's slots and ranks (``node.node_rank`` is its hostfile position).
        argv: the torchrun command the node runs.
        env: variables set for that command on top of the node's environment (the
            exports shared by all nodes, plus the node's ``CUDA_VISIBLE_DEVICES``).
    """

    node: NodePlan
    argv: tuple[str, ...]
    env: dict[str, str]


@dataclass(frozen=True)
class LaunchPlan:
    """Everything a runner needs; built by :func:`plan_launch`.

    Attributes:
        options: the options the plan was made from.
        resources: ``{host: [slots]}`` after filters, in hostfile order.
        nodes: one :class:`NodeLaunch` per host, in hostfile order.
        runner: ``"local"`` or a multi-node backend from :data:`LAUNCHERS`.
        master_addr: rank 0's host (the rendezvous endpoint).
        master_port: the rendezvous port.
        rendezvous: ``"static"`` or ``"c10d"``.
        nnodes: torchrun's ``--nnodes`` value: ``"N"`` or ``"min:max"``.
        exports: variables exported on every node (also inside each ``NodeLaunch.env``).
        world_info: URL-safe base64 of the resources, as DeepSpeed passes it.
    """

    options: LaunchOptions
    resources: dict[str, list[int]]
    nodes: tuple[NodeLaunch, ...]
    runner: str
    master_addr: str
    master_port: int
    rendezvous: str
    nnodes: str
    exports: dict[str, str]
    world_info: str

    @property
    def world_size(self) -> int:
        """Total number of processes (for an elastic run: with every host present)."""
        return sum(len(slots) for slots in self.resources.values())


def load_pool(hostfile: str | None) -> dict[str, int] | None:
    """Read the hostfile: an explicit path must exist, the default may be missing.

    Example:
        >>> load_pool("/nonexistent/hostfile")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        FileNotFoundError: Hostfile '/nonexistent/hostfile' does not exist. ...
    """
    if hostfile is None:
        return read_hostfile(DEFAULT_HOSTFILE, missing_ok=True)
    result = read_hostfile(hostfile, missing_ok=False)
    assert result is not None  # missing_ok=False raises instead
    return result


def resolve_resources(
    options: LaunchOptions,
    pool: Mapping[str, int] | None,
    device_count: int,
    environ: Mapping[str, str],
) -> dict[str, list[int]]:
    """Decide which slots on which hosts run a process (spec 9.2, plus CPU and local rules).

    Args:
        options: the launch options.
        pool: the parsed hostfile, or None when there is none.
        device_count: GPUs on this machine (0 on a CPU machine).
        environ: the environment (``CUDA_VISIBLE_DEVICES`` is read).

    Returns:
        ``{host: sorted slots}`` in hostfile order.

    Raises:
        ValueError: conflicting filters, unknown hosts or slots, several nodes requested
            without a hostfile (except with ``--launcher local``), or no resources.

    Example:
        >>> resolve_resources(LaunchOptions("t.py", num_gpus=2), None, 0, {})
        {'localhost': [0, 1]}
        >>> resolve_resources(LaunchOptions("t.py", launcher="local", num_nodes=2, num_gpus=1), None, 0, {})
        {'local-0': [0], 'local-1': [0]}
    """
    include, exclude = options.include, options.exclude
    num_nodes, num_gpus = options.num_nodes, options.num_gpus
    if pool is None:
        if num_nodes > 1 and options.launcher == LOCAL:
            # Simulated nodes: the only way to exercise multi-node launches on one machine.
            slots = num_gpus if num_gpus > 0 else max(device_count, 1)
            pool = {f"local-{i}": slots for i in range(num_nodes)}
            return select_resources(pool, include, exclude)
        if num_nodes > 1:
            raise ValueError(
                f"--num_nodes {num_nodes} needs a hostfile listing the nodes (--hostfile, lines 'host slots=N'); "
                "without one only this machine is used. To simulate several nodes on this machine, add "
                "--launcher local."
            )
        if device_count > 0:
            local: dict[str, int] = {"localhost": device_count}
            visible = environ.get("CUDA_VISIBLE_DEVICES", "").strip()
            ids = [int(s) for s in visible.split(",") if s.strip().isdigit()]
            if ids and not (include or exclude):
                if num_gpus != -1:
                    # --num_gpus N with CUDA_VISIBLE_DEVICES: the first N of those GPUs, not GPUs 0..N-1.
                    if num_gpus > len(ids):
                        raise ValueError(
                            f"--num_gpus {num_gpus} but CUDA_VISIBLE_DEVICES={visible} shows {len(ids)} GPU(s); "
                            "lower --num_gpus or widen CUDA_VISIBLE_DEVICES."
                        )
                    ids, num_gpus = ids[:num_gpus], -1
                include = include_from_visible_devices(",".join(str(i) for i in ids))
                # The ids name physical GPUs: make them valid slots even though this
                # process sees only len(ids) devices.
                local = {"localhost": max([device_count, *(i + 1 for i in ids)])}
        else:
            # No GPU: --num_gpus counts CPU processes; without it one process runs.
            local = {"localhost": num_gpus if num_gpus > 0 else 1}
        return select_resources(local, include, exclude, num_nodes, num_gpus)
    return select_resources(pool, include, exclude, num_nodes, num_gpus)


def find_deepspeed_config(user_args: Sequence[str]) -> str | None:
    """The ``--deepspeed_config`` (or ``--deepspeed-config``) path among the script's arguments.

    Example:
        >>> find_deepspeed_config(["--deepspeed", "--deepspeed_config", "ds.json"])
        'ds.json'
        >>> find_deepspeed_config(["--deepspeed_config=ds.json"])
        'ds.json'
    """
    for i, arg in enumerate(user_args):
        for flag in ("--deepspeed_config", "--deepspeed-config"):
            if arg == flag and i + 1 < len(user_args):
                return user_args[i + 1]
            if arg.startswith(flag + "="):
                return arg.split("=", 1)[1]
    return None


def _choose_runner(options: LaunchOptions, resources: Mapping[str, list[int]]) -> str:
    launcher = options.launcher.lower()
    if launcher not in LAUNCHERS:
        raise ValueError(f"--launcher {options.launcher!r} is not one of: {', '.join(LAUNCHERS)}.")
    if options.no_ssh:
        return LOCAL
    if len(resources) == 1 and not options.force_multi:
        return LOCAL
    return launcher


def _elastic_range(options: LaunchOptions, num_hosts: int) -> tuple[int, int]:
    low = options.min_elastic_nodes if options.min_elastic_nodes > 0 else 1
    high = options.max_elastic_nodes if options.max_elastic_nodes > 0 else num_hosts
    if low > high:
        raise ValueError(
            f"--min_elastic_nodes {low} is larger than --max_elastic_nodes {high}; the node range must be min <= max."
        )
    return low, high


def plan_launch(
    options: LaunchOptions,
    *,
    pool: Mapping[str, int] | None,
    device_count: int,
    environ: Mapping[str, str],
    cwd: str,
    env_files: Mapping[str, str] | None = None,
) -> LaunchPlan:
    """Plan a launch: resources, runner, rendezvous and every node's command.

    Args:
        options: the launch options.
        pool: the parsed hostfile (``{host: slots}``), or None without one.
        device_count: GPUs on this machine.
        environ: this machine's environment.
        cwd: the working directory (remote nodes ``cd`` there).
        env_files: ``{path: text}`` of existing ``.deepspeed_env``/``.shardwise_env``
            files, lowest precedence first.

    Raises:
        ValueError: any inconsistent option; the message names the option and a fix.

    Example:
        >>> plan = plan_launch(LaunchOptions("train.py", num_gpus=2, python="python"), pool=None,
        ...                    device_count=0, environ={}, cwd="/w")
        >>> plan.runner, plan.world_size, plan.nodes[0].argv[4:6]
        ('local', 2, ('--nnodes=1', '--nproc-per-node=2'))
    """
    if options.no_python and options.module:
        raise ValueError(
            "--no_python and --module exclude each other: the script is either a program or a module."
        )
    if options.elastic_training and options.no_local_rank:
        raise ValueError("--no_local_rank is not supported with --elastic_training (as in DeepSpeed).")
    if options.no_ssh and options.node_rank < 0:
        raise ValueError(
            "--no_ssh launches only this node: give its position in the hostfile with --node_rank."
        )
    if options.rdzv_backend not in (None, "static", "c10d"):
        raise ValueError(f"--rdzv_backend must be 'static' or 'c10d', got {options.rdzv_backend!r}.")
    if options.elastic_training and options.rdzv_backend == "static":
        raise ValueError(
            "--elastic_training needs the c10d rendezvous (nodes join and leave); drop --rdzv_backend."
        )
    if not 1 <= options.master_port <= 65535:
        raise ValueError(f"--master_port must be in 1..65535, got {options.master_port}.")

    resources = resolve_resources(options, pool, device_count, environ)
    runner = _choose_runner(options, resources)
    if runner in ("openmpi", "mpich", "impi", "mvapich") and (
        options.include or options.exclude or options.num_nodes != -1 or options.num_gpus != -1
    ):
        raise ValueError(
            f"--launcher {runner} starts every rank of the hostfile through mpirun: --include, --exclude, "
            "--num_nodes and --num_gpus cannot be honoured. Edit the hostfile instead (as with DeepSpeed)."
        )
    if options.elastic_training and runner in ("openmpi", "mpich", "impi", "mvapich", "slurm"):
        raise ValueError(
            f"--elastic_training cannot be honoured by --launcher {runner}: {_BINARIES_OF[runner]} starts every rank "
            "itself with a fixed world size (no torchrun agent, no c10d rendezvous), so no node can leave or join. "
            "Use --launcher pdsh, ssh or local for an elastic run, or drop --elastic_training."
        )
    nodes = assign_ranks(resources)
    if options.no_ssh and options.node_rank >= len(nodes):
        raise ValueError(
            f"--node_rank {options.node_rank} is out of range: the plan has {len(nodes)} node(s)."
        )

    all_local = runner == LOCAL
    if options.master_addr:
        master_addr = options.master_addr
    elif all_local and not options.no_ssh:
        master_addr = "127.0.0.1"
    else:
        first = nodes[0].host
        master_addr = "127.0.0.1" if first in _LOCAL_HOSTS else first

    rendezvous = "c10d" if options.elastic_training else (options.rdzv_backend or "static")
    if options.elastic_training:
        low, high = _elastic_range(options, len(nodes))
        nnodes = f"{low}:{high}"
    else:
        nnodes = str(len(nodes))

    exports = collect_exports(environ, env_files or {}, remote=not all_local, cwd=cwd)
    launches = []
    for node in nodes:
        env = dict(exports)
        if device_count > 0 or runner != LOCAL:
            env["CUDA_VISIBLE_DEVICES"] = node.visible_devices
        argv = torchrun_args(options, node, master_addr=master_addr, rendezvous=rendezvous, nnodes=nnodes)
        launches.append(NodeLaunch(node, tuple(argv), env))
    if options.no_ssh:
        launches = [launches[options.node_rank]]
    return LaunchPlan(
        options=options,
        resources=resources,
        nodes=tuple(launches),
        runner=runner,
        master_addr=master_addr,
        master_port=options.master_port,
        rendezvous=rendezvous,
        nnodes=nnodes,
        exports=exports,
        world_info=encode_world_info(resources),
    )


def describe_plan(plan: LaunchPlan) -> str:
    """A few lines for the log: hosts, ranks, rendezvous.

    Example:
        >>> plan = plan_launch(LaunchOptions("t.py", num_gpus=2, python="python"), pool=None,
        ...                    device_count=0, environ={}, cwd="/w")
        >>> print(describe_plan(plan))
        world info: {"localhost": [0, 1]}
        1 node(s), 2 process(es), runner local, static rendezvous at 127.0.0.1:29500
        node 0 localhost: ranks 0-1
    """
    lines = [
        f"world info: {json.dumps(plan.resources)}",
        f"{len(plan.nodes)} node(s), {plan.world_size} process(es), runner {plan.runner}, "
        f"{plan.rendezvous} rendezvous at {endpoint(plan.master_addr, plan.master_port)}"
        + (f", nnodes {plan.nnodes}" if ":" in plan.nnodes else ""),
    ]
    for launch in plan.nodes:
        ranks = launch.node.global_ranks
        span = f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else str(ranks[0])
        lines.append(f"node {launch.node.node_rank} {launch.node.host}: ranks {span}")
    return "\n".join(lines)
