"""Each node's command: torchrun's agent (``python -u -m shardwise.launcher.agent`` with its rendezvous
and restart options) followed by the worker (``-m shardwise.launcher.worker [flags] -- script args``).
Pure functions over :class:`~shardwise.launcher.planner.LaunchOptions` and a node's plan."""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardwise.launcher.resources import NodePlan

if TYPE_CHECKING:
    from shardwise.launcher.planner import LaunchOptions

__all__ = ["agent_restarts", "endpoint", "max_restarts", "rdzv_id", "torchrun_args", "torchrun_prefix", "worker_args"]


def worker_args(options: LaunchOptions) -> list[str]:
    """The worker entry (module and flags) that wraps the user's script on every rank.

    Example:
        >>> from shardwise.launcher.planner import LaunchOptions
        >>> worker_args(LaunchOptions("train.py", ("--lr", "1")))
        ['-m', 'shardwise.launcher.worker', '--', 'train.py', '--lr', '1']
    """
    flags = ["-m", "shardwise.launcher.worker"]
    if options.no_local_rank:
        flags.append("--no_local_rank")
    if options.module:
        flags.append("--module")
    if options.no_python:
        flags.append("--no_python")
    if options.bind_cores_to_rank:
        flags.append("--bind_cores_to_rank")
    if options.bind_core_list:
        flags.append(f"--bind_core_list={options.bind_core_list}")
    return [*flags, "--", options.user_script, *options.user_args]


def torchrun_prefix(
    *,
    python: str,
    nnodes: str,
    nproc_per_node: int,
    rendezvous: str,
    master_addr: str,
    master_port: int,
    node_rank: str | int,
    rdzv_id: str,
    max_restarts: int,
    log_dir: str | None = None,
) -> list[str]:
    """``python -u -m shardwise.launcher.agent`` (torchrun) and its options, up to the program to run.

    Static rendezvous: ``--master-addr``/``--master-port``/``--node-rank`` fix the node's
    rank (hostfile order). c10d: ``--rdzv-endpoint``/``--rdzv-id``, ranks assigned at join.

    Example:
        >>> torchrun_prefix(python="python", nnodes="1:2", nproc_per_node=1, rendezvous="c10d",
        ...                 master_addr="h0", master_port=29500, node_rank=0, rdzv_id="job", max_restarts=3)[4:]
        ['--nnodes=1:2', '--nproc-per-node=1', '--rdzv-backend=c10d', '--rdzv-endpoint=h0:29500', '--rdzv-id=job', '--rdzv-conf=is_host=true', '--max-restarts=3']
    """
    argv = [
        python,
        "-u",
        "-m",
        "shardwise.launcher.agent",
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc_per_node}",
    ]
    if rendezvous == "static":
        argv += [
            "--rdzv-backend=static",
            f"--master-addr={master_addr}",
            f"--master-port={master_port}",
            f"--node-rank={node_rank}",
        ]
    else:
        argv += [
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={endpoint(master_addr, master_port)}",
            f"--rdzv-id={rdzv_id}",
            # Only the first node's agent hosts the rendezvous store. torch otherwise lets every agent
            # whose machine owns the endpoint address race to host it, and with several agents on one
            # machine the winner may be a node that later leaves, taking the store with it.
            f"--rdzv-conf=is_host={'true' if str(node_rank) == '0' else 'false'}",
        ]
    argv.append(f"--max-restarts={max_restarts}")
    if log_dir:
        argv += [f"--log-dir={log_dir}", "--redirects=3"]
    return argv


def max_restarts(options: LaunchOptions) -> int:
    """torchrun's ``--max-restarts``: 0 for a fixed-size run (fail fast), 3 for an elastic one."""
    if options.max_restarts is not None:
        return options.max_restarts
    return 3 if options.elastic_training else 0


def agent_restarts(options: LaunchOptions, rendezvous: str, nnodes: str) -> int:
    """torchrun's ``--max-restarts`` on each node: :func:`max_restarts`, except 0 for a
    fixed-size job over several nodes (static rendezvous), which the launcher restarts as a
    whole instead: torch's static rendezvous never tells the other agents that one node
    restarted its ranks, so they would first wait out the collective timeout (and a node whose
    rank hangs would never restart at all).

    Example:
        >>> from shardwise.launcher.planner import LaunchOptions
        >>> options = LaunchOptions("t.py", max_restarts=2)
        >>> agent_restarts(options, "static", "1"), agent_restarts(options, "static", "3")
        (2, 0)
    """
    if rendezvous == "static" and nnodes.isdigit() and int(nnodes) > 1:
        return 0
    return max_restarts(options)


def rdzv_id(options: LaunchOptions) -> str:
    """The rendezvous id shared by every node of the job."""
    return options.rdzv_id or f"shardwise-{options.master_port}"


def torchrun_args(
    options: LaunchOptions,
    node: NodePlan,
    *,
    master_addr: str,
    rendezvous: str,
    nnodes: str,
    node_rank: str | None = None,
) -> list[str]:
    """One node's full ``python -u -m shardwise.launcher.agent ... -m shardwise.launcher.worker ...`` command.

    Args:
        options: the launch options.
        node: the node's plan (its slot count is ``--nproc-per-node``).
        master_addr: the rendezvous host.
        rendezvous: ``"static"`` (fixed node ranks) or ``"c10d"`` (elastic).
        nnodes: ``"N"`` or ``"min:max"``.
        node_rank: text for ``--node-rank``; default the node's rank.

    Example:
        >>> from shardwise.launcher.planner import LaunchOptions
        >>> from shardwise.launcher.resources import assign_ranks
        >>> node = assign_ranks({"a": [0, 1], "b": [0, 1]})[1]
        >>> args = torchrun_args(LaunchOptions("t.py", python="python"), node, master_addr="a",
        ...                      rendezvous="static", nnodes="2")
        >>> args[4:9]
        ['--nnodes=2', '--nproc-per-node=2', '--rdzv-backend=static', '--master-addr=a', '--master-port=29500']
        >>> args[9:]
        ['--node-rank=1', '--max-restarts=0', '-m', 'shardwise.launcher.worker', '--', 't.py']
    """
    prefix = torchrun_prefix(
        python=options.python,
        nnodes=nnodes,
        nproc_per_node=node.local_size,
        rendezvous=rendezvous,
        master_addr=master_addr,
        master_port=options.master_port,
        node_rank=node.node_rank if node_rank is None else node_rank,
        rdzv_id=rdzv_id(options),
        max_restarts=agent_restarts(options, rendezvous, nnodes),
        log_dir=options.each_rank_log,
    )
    return prefix + worker_args(options)


def endpoint(host: str, port: int) -> str:
    """``host:port``, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
