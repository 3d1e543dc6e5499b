"""``python -m shardwise.launcher [launcher options] script.py [args]``: the same as ``shardwise``."""

from __future__ import annotations

import sys

from shardwise.launcher.command import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m shardwise.launcher"))
