"""Installing the ``deepspeed`` compatibility package for a test, and removing every trace of it after."""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def installed_deepspeed(target: Path) -> Iterator[Any]:
    """Install the package into ``target``, import it, and afterwards remove every trace of it."""
    from shardwise.compat import forwarding, installer

    installer.install(target)
    sys.path.insert(0, str(target))
    try:
        yield importlib.import_module("deepspeed")
    finally:
        sys.path.remove(str(target))
        for name in [n for n in sys.modules if n == "deepspeed" or n.startswith("deepspeed.")]:
            del sys.modules[name]
        if forwarding._FINDER in sys.meta_path:
            sys.meta_path.remove(forwarding._FINDER)
