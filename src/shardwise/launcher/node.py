"""Per-node entry for backends that send one command line to every node (pdsh).

pdsh runs the same command on all hosts and replaces ``%n`` with each host's index, so the
per-node details (how many processes, which GPUs) cannot be in the command itself. Each
node runs::

    python -u -m shardwise.launcher.node --world_info=<b64> --node_rank=%n \\
        --master_addr=A --master_port=P --rendezvous=static --nnodes=N --max_restarts=0 \\
        -- -m shardwise.launcher.worker [flags] -- script.py args

which decodes the world info (DeepSpeed's ``{host: [slots]}``), takes its own slots, sets
``CUDA_VISIBLE_DEVICES`` to them and replaces itself with that node's torchrun, exactly the
command the other runners start directly (:func:`shardwise.launcher.planner.torchrun_prefix`).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from shardwise.launcher.resources import assign_ranks, decode_world_info
from shardwise.launcher.torchrun_command import torchrun_prefix

__all__ = ["main", "node_command"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m shardwise.launcher.node")
    parser.add_argument("--world_info", required=True)
    parser.add_argument("--node_rank", type=int, required=True)
    parser.add_argument("--master_addr", required=True)
    parser.add_argument("--master_port", type=int, required=True)
    parser.add_argument("--rendezvous", choices=("static", "c10d"), default="static")
    parser.add_argument("--nnodes", default=None, help="N or min:max; default the number of hosts")
    parser.add_argument("--rdzv_id", default="shardwise")
    parser.add_argument("--max_restarts", type=int, default=0)
    parser.add_argument("--log_dir", default=None)
    return parser


def node_command(argv: Sequence[str], python: str = sys.executable) -> tuple[list[str], dict[str, str]]:
    """The torchrun command and the variables for this node, from the node entry's arguments.

    Raises:
        ValueError: bad world info, or a node rank outside it.

    Example:
        >>> cmd, env = node_command(["--world_info=eyJhIjogWzAsIDFdLCAiYiI6IFsyXX0=", "--node_rank=1",
        ...     "--master_addr=a", "--master_port=29500", "--", "-m", "shardwise.launcher.worker", "--", "t.py"],
        ...     python="python")
        >>> cmd[4:6], env
        (['--nnodes=2', '--nproc-per-node=1'], {'CUDA_VISIBLE_DEVICES': '2'})
    """
    argv = list(argv)
    if "--" not in argv:
        raise ValueError("shardwise.launcher.node: expected '--' followed by the program each rank runs.")
    cut = argv.index("--")
    args = _parser().parse_args(argv[:cut])
    program = argv[cut + 1 :]
    nodes = assign_ranks(decode_world_info(args.world_info))
    if not 0 <= args.node_rank < len(nodes):
        raise ValueError(f"--node_rank {args.node_rank} is outside the world info's {len(nodes)} node(s).")
    node = nodes[args.node_rank]
    command = torchrun_prefix(
        python=python,
        nnodes=args.nnodes or str(len(nodes)),
        nproc_per_node=node.local_size,
        rendezvous=args.rendezvous,
        master_addr=args.master_addr,
        master_port=args.master_port,
        node_rank=args.node_rank,
        rdzv_id=args.rdzv_id,
        max_restarts=args.max_restarts,
        log_dir=args.log_dir,
    )
    return command + program, {"CUDA_VISIBLE_DEVICES": node.visible_devices}


def main(argv: Sequence[str] | None = None) -> int:
    """Replace this process with the node's torchrun agent."""
    command, env = node_command(sys.argv[1:] if argv is None else argv)
    os.environ.update(env)
    os.execv(command[0], command)
    return 0  # not reached: execv replaces the process


if __name__ == "__main__":
    sys.exit(main())
