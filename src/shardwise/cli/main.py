"""Entry point of the ``shardwise`` command.

Sub-commands: ``config`` (check / explain). Each sub-command lives in its own module
and registers itself with ``add_parser``; this file only dispatches.
"""

from __future__ import annotations

import argparse
import sys

from shardwise.cli import config_cmd


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser (sub-commands registered by their modules)."""
    parser = argparse.ArgumentParser(prog="shardwise", description="DeepSpeed-config training on PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True)
    config_cmd.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the process exit code."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
