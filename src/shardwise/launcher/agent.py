"""Every node's agent: torchrun's elastic agent, tied to its parent and announced to its ranks.

``python -u -m shardwise.launcher.agent [torchrun options] -m shardwise.launcher.worker ...``
takes exactly ``python -m torch.distributed.run``'s arguments and runs it in this process
after two steps (:mod:`shardwise.launcher.lifeline`):

1. arm SIGTERM for the death of whoever started it, so the agent stops its ranks, as on
   Ctrl-C, when its launcher is killed. The local launcher has armed it already, before
   ``exec``, and checked that it was still alive then (``run_commands``); this covers the
   remote nodes, where the parent is the shell that ssh/pdsh started;
2. put its pid in ``SHARDWISE_AGENT_PID`` for the ranks, so each rank can tie itself to
   this agent and see whether it died before the rank was ready.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence

from shardwise.launcher.lifeline import AGENT_PID_VAR, die_with_parent

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> None:
    """Arm the parent-death signal, announce this pid, run torchrun's ``main``."""
    die_with_parent(signal.SIGTERM, os.getppid())
    os.environ[AGENT_PID_VAR] = str(os.getpid())
    from torch.distributed.run import main as torchrun_main

    sys.argv[0] = "torchrun"  # torchrun's usage and error lines name itself, as before
    torchrun_main(None if argv is None else list(argv))


if __name__ == "__main__":
    main()
