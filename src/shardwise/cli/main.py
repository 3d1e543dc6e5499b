"""Entry point of the ``shardwise`` command.

``shardwise config|report|elastic|checkpoint|compat ...`` run a sub-command (each in its own module, which
registers itself with ``add_parser``); anything else is a launch, parsed exactly like
DeepSpeed's ``deepspeed`` command: ``shardwise [launcher options] script.py [script args]``.
This file only dispatches.

Example:
    shardwise config check ds_config.json
    shardwise report
    shardwise elastic ds_config.json --world-size 64
    shardwise checkpoint info checkpoints/
    shardwise --num_gpus 2 train.py --deepspeed --deepspeed_config ds.json
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from shardwise.cli import checkpoint_cmd, compat_cmd, config_cmd, elastic_cmd, plan_cmd, report_cmd

SUBCOMMANDS = ("config", "report", "elastic", "checkpoint", "compat")
"""First words that select a sub-command; any other first word starts a launch."""


def build_parser() -> argparse.ArgumentParser:
    """The sub-command parser (the launch parser is :func:`shardwise.launcher.command.build_parser`)."""
    parser = argparse.ArgumentParser(prog="shardwise", description="DeepSpeed-config training on PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True)
    config_cmd.add_parser(sub)
    plan_cmd.add_parser(sub)  # "config plan": registers under the config parser
    report_cmd.add_parser(sub)
    elastic_cmd.add_parser(sub)
    checkpoint_cmd.add_parser(sub)
    compat_cmd.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the process exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in SUBCOMMANDS:
        parsed = build_parser().parse_args(args)
        return int(parsed.func(parsed))
    from shardwise.launcher import command

    return command.main(args)


if __name__ == "__main__":
    raise SystemExit(main())
