"""``shardwise compat install-deepspeed|uninstall-deepspeed|status``: the ``deepspeed`` compatibility package.

Example:
    shardwise compat install-deepspeed            # into this interpreter's site-packages
    shardwise compat install-deepspeed --target DIR
    shardwise compat status
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


def add_parser(sub: Any) -> None:
    """Register ``compat`` and its three actions."""
    parser = sub.add_parser(
        "compat", help="the 'deepspeed' package that forwards to shardwise (for HF clients)"
    )
    actions = parser.add_subparsers(dest="action", required=True)
    for name, helptext in (
        ("install-deepspeed", "write the 'deepspeed' package, its dist-info and the 'deepspeed' command"),
        ("uninstall-deepspeed", "remove it (as `pip uninstall deepspeed` does)"),
        ("status", "say what 'import deepspeed' finds"),
    ):
        action = actions.add_parser(name, help=helptext)
        action.add_argument(
            "--target", default=None, help="site directory (default: this Python's site-packages)"
        )
        action.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the chosen action; 1 when a real DeepSpeed is in the way."""
    from shardwise.compat import installer

    try:
        if args.action == "install-deepspeed":
            files = installer.install(args.target)
            print(f"installed deepspeed {installer.PACKAGE_VERSION} (shardwise's compatibility package):")
            for path in files:
                print(f"  {path}")
        elif args.action == "uninstall-deepspeed":
            removed = installer.uninstall(args.target)
            print(f"removed {len(removed)} files" if removed else "nothing to remove")
        else:
            print(installer.status(args.target).describe())
    except installer.CompatInstallError as error:
        print(f"shardwise compat: {error}", file=sys.stderr)
        return 1
    return 0
