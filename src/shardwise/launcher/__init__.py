"""The ``shardwise`` launcher: DeepSpeed's launch options on torchrun's elastic agent.

* :mod:`~shardwise.launcher.hostfile`, :mod:`~shardwise.launcher.resources`,
  :mod:`~shardwise.launcher.planner`: pure planning (hostfile, include/exclude, ranks,
  every node's command);
* :mod:`~shardwise.launcher.runners`: the backends' command lines and the process runner;
* :mod:`~shardwise.launcher.agent`: every node's torchrun agent, tied to its launcher;
* :mod:`~shardwise.launcher.worker`: what each rank runs around the user's script;
* :mod:`~shardwise.launcher.lifeline`: parent-death signals, so no rank outlives its launcher;
* :mod:`~shardwise.launcher.node`: the per-node entry used by pdsh;
* :mod:`~shardwise.launcher.failures`: failure records and the closing summary;
* :mod:`~shardwise.launcher.command`: the launch command line (``shardwise script.py ...``), which
  the ``shardwise`` CLI dispatches to.

``python -m shardwise.launcher [options] script.py args`` is the same as ``shardwise``.
Importing this package does not import torch.

Example:
    >>> from shardwise.launcher import LaunchOptions, plan_launch
    >>> plan = plan_launch(LaunchOptions("train.py", num_gpus=2), pool=None, device_count=0,
    ...                    environ={}, cwd="/work")
    >>> plan.world_size
    2
"""

from __future__ import annotations

from shardwise.launcher.hostfile import parse_hostfile, read_hostfile
from shardwise.launcher.planner import LaunchOptions, LaunchPlan, NodeLaunch, plan_launch
from shardwise.launcher.resources import assign_ranks, select_resources
from shardwise.launcher.runners import RunnerCommand, build_commands

__all__ = [
    "LaunchOptions",
    "LaunchPlan",
    "NodeLaunch",
    "RunnerCommand",
    "assign_ranks",
    "build_commands",
    "parse_hostfile",
    "plan_launch",
    "read_hostfile",
    "select_resources",
]
