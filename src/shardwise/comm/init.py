"""Creating, adopting and tearing down the default process group.

:func:`init_distributed` has DeepSpeed's signature and covers the three ways a script
starts:

* under a launcher (torchrun, the shardwise launcher, mpirun, srun): the launcher's
  variables are read by :func:`shardwise.comm.env.discover_environment` and exported as
  ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT`` so torch's
  ``env://`` rendezvous (and any code that reads them) sees one consistent description;
* after the user (or a test harness, or another library) already created the group: it
  is adopted as is;
* as a plain ``python script.py``: a one-process world on 127.0.0.1 and a free port, so
  the same script runs unchanged on one process.

The rank/size queries answer rank 0 of a world of 1 when no group exists, as DeepSpeed's
config code does (spec 1.3), so single-process code paths need no special case.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from shardwise.comm import diagnostics, exchange
from shardwise.comm.env import DistEnv, discover_environment, timeout_from_env
from shardwise.utils.logging import logger

__all__ = [
    "available_backends",
    "barrier",
    "destroy_process_group",
    "get_backend",
    "get_global_rank",
    "get_local_rank",
    "get_rank",
    "get_world_group",
    "get_world_size",
    "group_source_rank",
    "init_distributed",
    "is_initialized",
    "new_group",
]

_LOOPBACK = "127.0.0.1"
# How this process joined the group; None until init_distributed ran (or after destroy).
_joined: DistEnv | None = None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((_LOOPBACK, 0))
        return int(sock.getsockname()[1])


def _default_backend() -> str:
    if torch.cuda.is_available() and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def _select_cuda_device(local_rank: int) -> None:
    """Pin this rank's GPU before NCCL creates its communicator (else all use GPU 0)."""
    count = torch.cuda.device_count()
    if count == 1:
        device = 0  # one GPU per task (CUDA_VISIBLE_DEVICES set per process by the launcher)
    elif local_rank < count:
        device = local_rank
    else:
        raise ValueError(
            f"local rank {local_rank} has no GPU: this node shows {count} GPUs. Launch at most {count} "
            "processes per node, or give each process its own GPU with CUDA_VISIBLE_DEVICES"
        )
    torch.cuda.set_device(device)


def _describe_job(
    environ: Mapping[str, str],
    *,
    distributed_port: int,
    auto_mpi_discovery: bool,
    env_rendezvous: bool,
    rank: int,
    world_size: int,
) -> DistEnv:
    """The job as the environment (overridden by explicit rank/world_size) describes it."""
    if (rank >= 0) != (world_size >= 1):
        raise ValueError(
            f"init_distributed(rank={rank}, world_size={world_size}): pass both rank and world_size, or "
            "neither (then they come from the launcher's environment)"
        )
    view = dict(environ)
    if rank >= 0:
        # Explicit arguments win over every launcher's variables.
        view.update({"RANK": str(rank), "WORLD_SIZE": str(world_size)})
    found = discover_environment(
        view,
        default_port=distributed_port,
        auto_mpi_discovery=auto_mpi_discovery,
        require_master=env_rendezvous,
    )
    if found is not None:
        return found
    slurm_tasks = view.get("SLURM_NTASKS", "").strip()
    if auto_mpi_discovery and slurm_tasks.isdigit() and int(slurm_tasks) > 1:
        # Inside an sbatch script but not started by srun: say why only one rank runs.
        logger.warning(
            "init_distributed: this SLURM job has %s tasks but this process was not started by srun, so it "
            "runs as a single process; launch it with srun (or the shardwise launcher) to use all of them",
            slurm_tasks,
        )
    # A plain `python script.py`: a world of one on loopback.
    return DistEnv(
        rank=0,
        world_size=1,
        local_rank=0,
        local_world_size=1,
        master_addr=_LOOPBACK,
        master_port=_free_port() if env_rendezvous else 0,
        launcher="single-process",
    )


def _attempt_store(job: DistEnv, timeout: timedelta) -> dist.Store | None:
    """Under torchrun's agent store, a key space of this restart attempt's own.

    Why by hand: torch's static rendezvous keeps one ``TCPStore`` for the agent's whole life,
    and its workers connect to it without a per-attempt prefix (torch 2.13,
    ``distributed/rendezvous.py::_create_c10d_store`` assumes a new store per retry). After a
    restart, attempt k then reads attempt k-1's keys: a peer's old gloo address ("Gloo
    connectFullMesh failed ... Connection refused") or an old barrier counter (a hang). The
    keys of each attempt go under ``shardwise/attempt_<TORCHELASTIC_RESTART_COUNT>`` instead.
    None outside torchrun (torch's own ``env://`` store is right there).
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True) or not job.master_addr:
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    client = dist.TCPStore(
        host_name=job.master_addr,
        port=job.master_port,
        world_size=job.world_size,
        is_master=False,
        timeout=timeout,
    )
    return dist.PrefixStore(f"shardwise/attempt_{attempt}", client)


def store_client(host: str, port: int, timeout: timedelta) -> dist.Store:
    """A client of the ``TCPStore`` served at ``host:port`` (torchrun's static rendezvous store,
    which the node agents use to tell each other that the job failed; see
    :mod:`shardwise.launcher.agent`).

    Raises:
        RuntimeError: no store answered within ``timeout`` (torch's connect error).
    """
    return dist.TCPStore(host_name=host, port=port, is_master=False, timeout=timeout, wait_for_workers=False)


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = 29500,
    verbose: bool = True,
    timeout: timedelta | None = None,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: object = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Create the default process group, or adopt the one that exists.

    Args:
        dist_backend: ``"nccl"``, ``"gloo"`` or any backend string torch accepts
            (``"cpu:gloo,cuda:nccl"``); default nccl when CUDA is available, else gloo.
        auto_mpi_discovery: also read OpenMPI, MPICH/Intel MPI and SLURM variables.
        distributed_port: rendezvous port when ``MASTER_PORT`` is not set.
        verbose: log one INFO line on rank 0 describing the group.
        timeout: collective timeout; default from ``SHARDWISE_TIMEOUT_SECONDS``,
            ``SHARDWISE_TIMEOUT`` or ``DEEPSPEED_TIMEOUT`` (minutes), else 10 minutes.
            A collective that does not complete in time fails on the ranks waiting in
            it, with a report naming the ranks that did not arrive and where they are
            (:mod:`shardwise.comm.diagnostics`; torch's flight recorder is switched on
            unless ``SHARDWISE_FLIGHT_RECORDER=0``).
        init_method: torch rendezvous URL; default ``env://`` from the discovered variables.
        dist_init_required: False skips initialisation entirely (DeepSpeed's meaning);
            None or True initialise unless a group already exists.
        config: accepted for DeepSpeed compatibility; the comms logger reads its own
            config section elsewhere.
        rank: explicit global rank (with ``world_size``), overriding the environment.
        world_size: explicit world size (with ``rank``).

    Raises:
        ValueError: the environment is incomplete (the message names the variable to set),
            ``rank``/``world_size`` are given alone, or a rank has no GPU.

    Example:
        >>> import shardwise
        >>> # shardwise.init_distributed()
        >>> # shardwise.comm.get_rank(), shardwise.comm.get_world_size()
        >>> # -> (0, 1)
    """
    global _joined
    del config  # DeepSpeed uses it only for its comms logger
    if dist_init_required is False:
        return
    if dist.is_initialized():
        if _joined is None:
            _joined = _adopted()
        diagnostics.install()
        logger.debug("init_distributed: adopting the existing %s process group", dist.get_backend())
        return

    env_rendezvous = init_method is None or init_method.startswith("env://")
    job = _describe_job(
        os.environ,
        distributed_port=distributed_port,
        auto_mpi_discovery=auto_mpi_discovery,
        env_rendezvous=env_rendezvous,
        rank=rank,
        world_size=world_size,
    )
    # Exported so torch's env:// and user code that reads RANK/LOCAL_RANK agree with us.
    os.environ.update(job.torch_env())
    backend = dist_backend or _default_backend()
    if "nccl" in backend and torch.cuda.is_available():
        _select_cuda_device(job.local_rank)
    timeout = timeout if timeout is not None else timeout_from_env(os.environ)
    # Before the group exists: the flight recorder is configured when the group is created.
    diagnostics.enable_flight_recorder(os.environ)
    store = _attempt_store(job, timeout) if env_rendezvous else None
    dist.init_process_group(
        backend=backend,
        init_method=None if store is not None else init_method or "env://",
        store=store,
        timeout=timeout,
        world_size=job.world_size,
        rank=job.rank,
    )
    _joined = job
    # Every rank answers "where are you?" so a timeout names the ranks that did not arrive.
    diagnostics.install()
    if verbose:
        where = f"{job.master_addr}:{job.master_port}" if env_rendezvous else init_method
        logger.info(
            "init_distributed: backend=%s world_size=%d launcher=%s rendezvous=%s timeout=%ss",
            backend,
            job.world_size,
            job.launcher,
            where,
            int(timeout.total_seconds()),
        )


def _adopted() -> DistEnv:
    """Describe a process group someone else created (local rank from the environment)."""
    local_rank = os.environ.get("LOCAL_RANK", "").strip()
    local_size = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    return DistEnv(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=int(local_rank) if local_rank.isdigit() else 0,
        local_world_size=int(local_size) if local_size.isdigit() else None,
        master_addr=os.environ.get("MASTER_ADDR", ""),
        master_port=int(os.environ.get("MASTER_PORT", "0") or 0),
        launcher="adopted",
    )


def is_initialized() -> bool:
    """Whether the default process group exists."""
    return dist.is_available() and dist.is_initialized()


def get_rank(group: dist.ProcessGroup | None = None) -> int:
    """This process's rank in ``group`` (default: the world); 0 when no group exists."""
    if not is_initialized():
        return 0
    return dist.get_rank(group)


def get_world_size(group: dist.ProcessGroup | None = None) -> int:
    """Number of ranks in ``group`` (default: the world); 1 when no group exists."""
    if not is_initialized():
        return 1
    return dist.get_world_size(group)


def get_backend(group: dist.ProcessGroup | None = None) -> str:
    """The backend of ``group`` (default: the world): ``"nccl"``, ``"gloo"``, ``"cpu:gloo,cuda:nccl"``...;
    ``""`` when no group exists."""
    if not is_initialized():
        return ""
    return str(dist.get_backend(group))


def available_backends() -> dict[str, bool]:
    """Which process-group backends this torch build offers (for ``shardwise report``)."""
    available = dist.is_available()
    return {
        "gloo": available and dist.is_gloo_available(),
        "nccl": available and dist.is_nccl_available(),
        "mpi": available and dist.is_mpi_available(),
        "ucc": available and bool(getattr(dist, "is_ucc_available", lambda: False)()),
    }


def get_local_rank() -> int:
    """This process's rank on its node (its GPU index); 0 when unknown."""
    if _joined is not None:
        return _joined.local_rank
    raw = os.environ.get("LOCAL_RANK", "").strip()
    return int(raw) if raw.isdigit() else 0


def get_global_rank(group: dist.ProcessGroup | None, group_rank: int) -> int:
    """The world rank of ``group_rank`` within ``group`` (None: the world)."""
    if group is None:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def group_ranks(group: dist.ProcessGroup | None) -> list[int] | None:
    """The world ranks of ``group``'s members in group order (None: the world, returned as None,
    which is how ``new_group`` spells "every rank")."""
    return None if group is None else dist.get_process_group_ranks(group)


def group_source_rank(group: dist.ProcessGroup | None) -> int:
    """The world rank of ``group``'s first member (None: the world, so 0).

    Broadcasts name their source by world rank; "the group's first rank" is the usual one.
    """
    return get_global_rank(group, 0)


def get_world_group() -> dist.ProcessGroup:
    """The default (world) process group."""
    if not is_initialized():
        raise RuntimeError("no process group exists yet: call shardwise.init_distributed() first")
    group = dist.group.WORLD
    assert group is not None  # initialised above
    return group


def new_group(ranks: list[int] | None = None, **kwargs: Any) -> dist.ProcessGroup | None:
    """Create a sub-group; every rank of the world must call this (torch's rule)."""
    return dist.new_group(ranks, **kwargs)


def barrier(
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    device_ids: list[int] | None = None,
    prof: bool = False,
    log_name: str = "barrier",
    debug: object = None,
) -> dist.Work | None:
    """Wait until every rank of ``group`` arrives; a no-op when no group exists. DeepSpeed's signature:
    ``async_op`` returns the work, ``device_ids`` names the GPU (NCCL); ``prof``/``log_name`` record the
    barrier in the comms logger (``debug``: DeepSpeed's caller tag, replaced by the logger's own setting)."""
    if not is_initialized():
        return None
    from shardwise.comm.comms_logger import COMMS_LOGGER

    record = COMMS_LOGGER.start(log_name, 0, dist.get_world_size(group), False, force=prof) if COMMS_LOGGER.enabled else None
    work = dist.barrier(group, async_op=async_op, device_ids=device_ids)
    if record is not None:
        record.complete()
    return work


DRAIN_TIMEOUT = timedelta(seconds=10)
"""How long :func:`destroy_process_group` waits for the other ranks before tearing down anyway."""


def destroy_process_group() -> None:
    """Tear down the default group (if any), so a later init starts afresh.

    When this process sent point-to-point messages (:mod:`shardwise.comm.exchange`: 2-rank gloo
    reduce-scatters and all-gathers), the ranks first meet in a barrier of at most
    :data:`DRAIN_TIMEOUT`: gloo calls a send complete once its transport has the buffer, and tearing
    the transport down while a peer still receives aborts the process at exit ("terminate called
    without an active exception", seen in about one run in six of DeepSpeed's 2-rank dispatch test).
    A rank that does not arrive in time is logged and the group is torn down anyway.
    """
    global _joined
    diagnostics.uninstall()  # its thread holds a connection to the group's store
    if is_initialized():
        if exchange.take_sent():
            _drain_point_to_point()
        dist.destroy_process_group()
    _joined = None


def _drain_point_to_point() -> None:
    """Every rank past its last receive before the transport closes (bounded; see destroy_process_group)."""
    try:
        dist.monitored_barrier(timeout=DRAIN_TIMEOUT)
    except RuntimeError as exc:  # a rank left or hangs: tear down regardless, and say so
        logger.warning("destroy_process_group: not every rank arrived within %ss to drain point-to-point "
                       "messages (%s); tearing down anyway", int(DRAIN_TIMEOUT.total_seconds()), exc)
