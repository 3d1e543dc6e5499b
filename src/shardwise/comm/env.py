"""Which launcher started this process, and where is rank 0? Read from the environment.

Pure functions over a ``Mapping[str, str]`` (normally ``os.environ``): no torch, no
sockets, tested in milliseconds. :func:`discover_environment` turns the variables of the
usual launchers into one :class:`DistEnv`; ``shardwise.comm.init`` exports it as the
variables torch's ``env://`` rendezvous reads.

Launchers, in order of precedence (the first whose rank *and* world-size variables are both
present wins; the others are ignored):

============  ==========================================================================
torchrun      ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` (or
              ``LOCAL_SIZE``), ``MASTER_ADDR``, ``MASTER_PORT``. Also what the shardwise
              launcher and the test harness set.
openmpi       ``OMPI_COMM_WORLD_RANK``/``_SIZE``/``_LOCAL_RANK``/``_LOCAL_SIZE``.
mpich         MPICH and Intel MPI (hydra): ``PMI_RANK``, ``PMI_SIZE``,
              ``MPI_LOCALRANKID``, ``MPI_LOCALNRANKS``.
slurm         a task started by ``srun``: ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS`` (or
              ``SLURM_NTASKS``), ``SLURM_LOCALID``, tasks per node from
              ``SLURM_STEP_TASKS_PER_NODE``/``SLURM_TASKS_PER_NODE`` (``"2(x3),1"``) or
              ``SLURM_NTASKS_PER_NODE``.
============  ==========================================================================

Why this order: explicit variables beat inferred ones. ``torchrun`` inside a SLURM
allocation sees both its own variables and SLURM's, and its own are the truth for the
processes it started; ``mpirun`` inside an allocation likewise. SLURM comes last because
its variables are present in every process of a job.

SLURM tasks are recognised only inside a job *step* (``SLURM_STEP_ID`` set, as ``srun``
does). The batch script itself also has ``SLURM_PROCID=0`` and ``SLURM_NTASKS=N``; reading
those would make ``python train.py`` run directly in an ``sbatch`` script wait forever for
N-1 partners that were never started. Such a process runs as a single-process world.

Rank 0's address: ``MASTER_ADDR`` always wins when set (a user override works for every
launcher). Otherwise, when every rank is on this node, ``127.0.0.1``. Under SLURM, the
first host of the step's node list (``SLURM_STEP_NODELIST``, then ``SLURM_JOB_NODELIST``):
with SLURM's task layouts rank 0 runs on the step's first node. ``SLURM_LAUNCH_NODE_IPADDR``
is only a fallback, because it is where ``srun`` ran, which is a login node when ``srun`` is
called from an interactive shell there. The port is ``MASTER_PORT``, else the caller's
``default_port`` (``init_distributed``'s ``distributed_port``, 29500 as in DeepSpeed).

Example:
    >>> from shardwise.comm.env import discover_environment
    >>> env = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
    ...        "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    >>> d = discover_environment(env, default_port=29500)
    >>> (d.launcher, d.rank, d.world_size, d.master_addr, d.master_port)
    ('openmpi', 1, 2, '127.0.0.1', 29500)
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

__all__ = [
    "DEFAULT_TIMEOUT_MINUTES",
    "DistEnv",
    "discover_environment",
    "expand_nodelist",
    "parse_tasks_per_node",
    "timeout_from_env",
]

DEFAULT_TIMEOUT_MINUTES = 10  # DeepSpeed's default collective timeout
_LOOPBACK = "127.0.0.1"
# SLURM's step id of the batch script and of the "extern" step: not srun-launched tasks.
_NON_TASK_STEP_IDS = frozenset({"batch", "extern", "interactive", "4294967294", "4294967295", "4294967293"})


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job, as its launcher described it.

    Attributes:
        rank: global rank, ``0 <= rank < world_size``.
        world_size: number of processes in the job.
        local_rank: rank among the processes on this node (selects the GPU).
        local_world_size: processes on this node, or None when the launcher did not say.
        master_addr: host rank 0 listens on for the rendezvous (``""`` if unknown and not
            required).
        master_port: TCP port of that rendezvous (``0`` if unknown and not required).
        launcher: ``"torchrun"``, ``"openmpi"``, ``"mpich"`` or ``"slurm"``.
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int | None
    master_addr: str
    master_port: int
    launcher: str

    def torch_env(self) -> dict[str, str]:
        """The variables torch's ``env://`` rendezvous (and DeepSpeed scripts) read."""
        out = {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(self.local_rank)}
        if self.master_addr:
            out["MASTER_ADDR"] = self.master_addr
        if self.master_port:
            out["MASTER_PORT"] = str(self.master_port)
        if self.local_world_size is not None:
            out["LOCAL_WORLD_SIZE"] = str(self.local_world_size)
        return out


@dataclass(frozen=True)
class _Launcher:
    """The variable names one launcher uses; local world size may come from several."""

    name: str
    rank: str
    world_size: str
    local_rank: str
    local_world_size: tuple[str, ...]


_TORCHRUN = _Launcher("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"))
_OPENMPI = _Launcher(
    "openmpi",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    ("OMPI_COMM_WORLD_LOCAL_SIZE",),
)
_MPICH = _Launcher("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", ("MPI_LOCALNRANKS",))


def _int_var(env: Mapping[str, str], name: str, *, minimum: int = 0) -> int:
    raw = env[name]
    try:
        value = int(raw.strip())
    except ValueError:
        raise ValueError(
            f"environment variable {name}={raw!r} is not an integer; unset it or fix its value"
        ) from None
    if value < minimum:
        raise ValueError(f"environment variable {name}={raw!r} must be >= {minimum}")
    return value


def _first_int(env: Mapping[str, str], names: tuple[str, ...], *, minimum: int = 0) -> int | None:
    for name in names:
        if name in env and env[name].strip():
            return _int_var(env, name, minimum=minimum)
    return None


def _port(env: Mapping[str, str], default_port: int | None, launcher: str, *, required: bool = True) -> int:
    if not required and not env.get("MASTER_PORT", "").strip() and default_port is None:
        return 0
    if env.get("MASTER_PORT", "").strip():
        port = _int_var(env, "MASTER_PORT", minimum=1)
    elif default_port is not None:
        port = default_port
    else:
        raise ValueError(
            f"the {launcher} environment gives no rendezvous port: set MASTER_PORT to a free TCP port "
            "on rank 0's host (e.g. MASTER_PORT=29500)"
        )
    if not 0 < port < 65536:
        raise ValueError(f"rendezvous port {port} is outside 1-65535: set MASTER_PORT to a valid port")
    return port


def _master_addr(
    env: Mapping[str, str],
    *,
    world_size: int,
    local_world_size: int | None,
    launcher: str,
    required: bool = True,
) -> str:
    addr = env.get("MASTER_ADDR", "").strip()
    if addr:
        return addr
    if world_size == 1 or local_world_size == world_size:
        return _LOOPBACK  # every rank runs on this node
    if launcher == "slurm":
        for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
            if env.get(name, "").strip():
                return expand_nodelist(env[name])[0]
        if env.get("SLURM_LAUNCH_NODE_IPADDR", "").strip():
            return env["SLURM_LAUNCH_NODE_IPADDR"].strip()
    if not required:
        return ""
    raise ValueError(
        f"the {launcher} environment describes {world_size} ranks over several nodes but not where rank 0 "
        "runs: set MASTER_ADDR to the address of rank 0's host for every rank (e.g. with mpirun: "
        "-x MASTER_ADDR=<host of rank 0>)"
    )


def _from_launcher(
    env: Mapping[str, str], launcher: _Launcher, default_port: int | None, require_master: bool
) -> DistEnv:
    world_size = _int_var(env, launcher.world_size, minimum=1)
    rank = _int_var(env, launcher.rank)
    local_world_size = _first_int(env, launcher.local_world_size, minimum=1)
    if env.get(launcher.local_rank, "").strip():
        local_rank = _int_var(env, launcher.local_rank)
    elif world_size == 1:
        local_rank = 0
    else:
        raise ValueError(
            f"{launcher.rank} and {launcher.world_size} are set but {launcher.local_rank} is not: set "
            f"{launcher.local_rank} to this process's rank on its node (it selects the GPU)"
        )
    return _checked(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=local_world_size,
        master_addr=_master_addr(
            env,
            world_size=world_size,
            local_world_size=local_world_size,
            launcher=launcher.name,
            required=require_master,
        ),
        master_port=_port(env, default_port, launcher.name, required=require_master),
        launcher=launcher.name,
    )


def _is_srun_task(env: Mapping[str, str]) -> bool:
    if not env.get("SLURM_PROCID", "").strip():
        return False
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID", "")).strip()
    return bool(step) and step.lower() not in _NON_TASK_STEP_IDS


def _from_slurm(env: Mapping[str, str], default_port: int | None, require_master: bool) -> DistEnv:
    size_var = next(
        (n for n in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS") if env.get(n, "").strip()), None
    )
    if size_var is None:
        raise ValueError(
            "SLURM_PROCID is set but no task count is: run the job through srun (which sets "
            "SLURM_STEP_NUM_TASKS), or set RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT yourself"
        )
    world_size = _int_var(env, size_var, minimum=1)
    rank = _int_var(env, "SLURM_PROCID")
    local_rank = _int_var(env, "SLURM_LOCALID") if env.get("SLURM_LOCALID", "").strip() else None
    if local_rank is None:
        if world_size != 1:
            raise ValueError("SLURM_PROCID is set but SLURM_LOCALID is not: launch the tasks with srun")
        local_rank = 0
    local_world_size = None
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        if env.get(name, "").strip():
            per_node = parse_tasks_per_node(env[name])
            node = _int_var(env, "SLURM_NODEID") if env.get("SLURM_NODEID", "").strip() else 0
            if node < len(per_node):
                local_world_size = per_node[node]
            break
    if local_world_size is None:
        local_world_size = _first_int(env, ("SLURM_NTASKS_PER_NODE",), minimum=1)
    return _checked(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=local_world_size,
        master_addr=_master_addr(
            env,
            world_size=world_size,
            local_world_size=local_world_size,
            launcher="slurm",
            required=require_master,
        ),
        master_port=_port(env, default_port, "slurm", required=require_master),
        launcher="slurm",
    )


def _checked(**fields: object) -> DistEnv:
    d = DistEnv(**fields)  # type: ignore[arg-type]
    if d.rank >= d.world_size:
        raise ValueError(
            f"the {d.launcher} environment says rank {d.rank} of world size {d.world_size}: the rank must be "
            "below the world size; check the launcher's variables"
        )
    if d.local_world_size is not None:
        if d.local_world_size > d.world_size:
            raise ValueError(
                f"the {d.launcher} environment says {d.local_world_size} ranks on this node but "
                f"{d.world_size} in total: the local world size cannot exceed the world size"
            )
        if d.local_rank >= d.local_world_size:
            raise ValueError(
                f"the {d.launcher} environment says local rank {d.local_rank} of {d.local_world_size} on "
                "this node: the local rank must be below the local world size"
            )
    return d


def discover_environment(
    env: Mapping[str, str],
    *,
    default_port: int | None = None,
    auto_mpi_discovery: bool = True,
    require_master: bool = True,
) -> DistEnv | None:
    """Describe this process's place in a multi-process job from its environment.

    Args:
        env: the environment, normally ``os.environ``.
        default_port: rendezvous port used when ``MASTER_PORT`` is not set; None makes a
            missing ``MASTER_PORT`` an error.
        auto_mpi_discovery: also read OpenMPI, MPICH/Intel MPI and SLURM variables
            (DeepSpeed's flag of the same name); False reads only torchrun's.
        require_master: False when the rendezvous comes from elsewhere (an explicit
            ``init_method`` such as ``tcp://host:port``): a missing address is then
            returned as ``""`` and a missing port as ``0`` instead of raising.

    Returns:
        The description, or None when no launcher variables are present (a plain
        ``python script.py``).

    Raises:
        ValueError: the variables are incomplete or inconsistent; the message names the
            variable to set or fix.

    Example:
        >>> discover_environment({}) is None
        True
        >>> d = discover_environment({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "1234"})
        >>> (d.launcher, d.local_rank, d.master_addr, d.master_port)
        ('torchrun', 0, '127.0.0.1', 1234)
    """
    launchers = [_TORCHRUN, _OPENMPI, _MPICH] if auto_mpi_discovery else [_TORCHRUN]
    for launcher in launchers:
        has_rank = bool(env.get(launcher.rank, "").strip())
        has_size = bool(env.get(launcher.world_size, "").strip())
        if has_rank and has_size:
            return _from_launcher(env, launcher, default_port, require_master)
        if launcher is _TORCHRUN and has_rank != has_size:
            present, missing = (
                (launcher.rank, launcher.world_size) if has_rank else (launcher.world_size, launcher.rank)
            )
            raise ValueError(
                f"{present} is set but {missing} is not: set both, or neither for a single process"
            )
    if auto_mpi_discovery and _is_srun_task(env):
        return _from_slurm(env, default_port, require_master)
    return None


# --------------------------------------------------------------------------------------
# SLURM's compressed host and task lists.
# --------------------------------------------------------------------------------------

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside brackets: ``"a[1,2],b"`` -> ``["a[1,2]", "b"]``."""
    parts: list[str] = []
    depth, start = 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"node list {text!r} has an unmatched ']'")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"node list {text!r} has an unmatched '['")
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _expand_ranges(spec: str, whole: str) -> list[str]:
    """``"01-03,07"`` -> ``["01", "02", "03", "07"]``; zero padding follows the lower bound."""
    out: list[str] = []
    for item in spec.split(","):
        m = _RANGE.match(item.strip())
        if m is None:
            raise ValueError(f"node list {whole!r}: {item!r} is not a number or a range like 01-03")
        lo_text, hi_text = m.group(1), m.group(2)
        lo = int(lo_text)
        hi = int(hi_text) if hi_text is not None else lo
        if hi < lo:
            raise ValueError(f"node list {whole!r}: range {item!r} runs backwards")
        width = len(lo_text)
        out.extend(str(n).zfill(width) for n in range(lo, hi + 1))
    return out


def _expand_host(pattern: str, whole: str) -> list[str]:
    """Expand one host pattern, possibly with several bracket groups (cartesian product)."""
    open_at = pattern.find("[")
    if open_at < 0:
        return [pattern]
    close_at = pattern.find("]", open_at)
    prefix, spec, rest = pattern[:open_at], pattern[open_at + 1 : close_at], pattern[close_at + 1 :]
    tails = _expand_host(rest, whole)
    return [prefix + mid + tail for mid in _expand_ranges(spec, whole) for tail in tails]


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand SLURM's compressed host list into host names, in order.

    Args:
        nodelist: e.g. ``"node[01-03,07]"``, ``"a1,b[2-3]"`` or ``"rack[1-2]-n[1-2]"``.

    Returns:
        The host names, in SLURM's order.

    Raises:
        ValueError: the list is empty or malformed.

    Example:
        >>> expand_nodelist("node[01-03,07]")
        ['node01', 'node02', 'node03', 'node07']
        >>> expand_nodelist("a1,b[2-3]")
        ['a1', 'b2', 'b3']
    """
    hosts = [host for part in _split_top_level(nodelist) for host in _expand_host(part, nodelist)]
    if not hosts:
        raise ValueError(f"node list {nodelist!r} names no hosts")
    return hosts


_TASKS = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def parse_tasks_per_node(text: str) -> list[int]:
    """Expand SLURM's task counts per node: ``"2(x3),1"`` -> ``[2, 2, 2, 1]``.

    Example:
        >>> parse_tasks_per_node("2(x3),1")
        [2, 2, 2, 1]
    """
    out: list[int] = []
    for item in text.split(","):
        m = _TASKS.match(item.strip())
        if m is None:
            raise ValueError(f"tasks-per-node list {text!r}: {item!r} is not like 4 or 2(x3)")
        out.extend([int(m.group(1))] * int(m.group(2) or 1))
    return out


# --------------------------------------------------------------------------------------
# Collective timeout.
# --------------------------------------------------------------------------------------


def _positive_float(env: Mapping[str, str], name: str) -> float:
    raw = env[name]
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise ValueError(f"environment variable {name}={raw!r} must be a positive, finite number")
    return value


def timeout_from_env(env: Mapping[str, str]) -> timedelta:
    """The collective timeout: how long a rank waits for its peers before failing.

    Read, first match wins, from ``SHARDWISE_TIMEOUT_SECONDS`` (seconds, for tests),
    ``SHARDWISE_TIMEOUT`` (minutes), ``DEEPSPEED_TIMEOUT`` (minutes, as DeepSpeed reads
    it); default 10 minutes, DeepSpeed's default.

    Raises:
        ValueError: a variable is set but is not a positive number.

    Example:
        >>> timeout_from_env({"DEEPSPEED_TIMEOUT": "30"}).total_seconds()
        1800.0
        >>> timeout_from_env({}).total_seconds()
        600.0
    """
    if env.get("SHARDWISE_TIMEOUT_SECONDS", "").strip():
        return timedelta(seconds=_positive_float(env, "SHARDWISE_TIMEOUT_SECONDS"))
    for name in ("SHARDWISE_TIMEOUT", "DEEPSPEED_TIMEOUT"):
        if env.get(name, "").strip():
            return timedelta(minutes=_positive_float(env, name))
    return timedelta(minutes=DEFAULT_TIMEOUT_MINUTES)
