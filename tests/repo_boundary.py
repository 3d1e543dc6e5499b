"""Which files the tests touch outside the repository (a test must need nothing beside the checkout).

``conftest.py`` installs an audit hook (``sys.addaudithook``) that records every ``open`` and directory
listing of a path outside the repository and outside the places any Python program reads (the
interpreter and its packages, the temporary directory, system folders, dot-folders of the home
directory). ``conftest.py`` fails the test during which such a path was touched, naming the path.
Subprocesses (spawned ranks, CLI runs) are not watched: their files are named by the tests that start them.
"""

from __future__ import annotations

import os
import site
import sys
import sysconfig
import tempfile
from collections.abc import Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

#: system folders every program may read (libraries, devices, /proc, locale and zone data)
SYSTEM_ROOTS = ("/proc", "/sys", "/dev", "/etc", "/usr", "/lib", "/lib64", "/bin", "/sbin", "/run", "/var")

#: audit events that read a path: its first argument
READ_EVENTS = frozenset({"open", "os.listdir", "os.scandir"})


def _prefix(path: str | Path) -> str:
    text = os.path.abspath(os.fspath(path))
    return text if text.endswith(os.sep) else text + os.sep


class Boundary:
    """Decides whether a path is outside the repository and every allowed root.

    A path beside the checkout (under the repository's parent folder, not in the repository) is
    outside even when an allowed root holds it (a clone inside the temporary directory), unless that
    parent is itself an allowed root or holds one (``/``, the temporary directory): siblings and other
    programs' files cannot be told apart there. ``dot_entries_of`` names folders (the home directory)
    whose hidden entries are all allowed, present or not: tools' settings and caches (``~/.cache``,
    ``~/.config``, ``~/.pdbrc``, ``~/.netrc``, ...).
    """

    def __init__(
        self, repo: Path, allowed: Iterable[str | Path], dot_entries_of: Iterable[str | Path] = ()
    ) -> None:
        self.repo = _prefix(repo)
        self.roots = tuple(_prefix(p) for p in allowed)
        self.dot_parents = tuple(_prefix(p) for p in dot_entries_of)
        parent = _prefix(Path(repo).parent)
        holds_root = any(root.startswith(parent) and not root.startswith(self.repo) for root in self.roots)
        self.beside = None if holds_root else parent  # (roots inside the repository, its .venv, aside)

    def outside(self, path: str) -> bool:
        """True when ``path`` (absolute, or relative to the working directory) is under no root."""
        candidate = _prefix(path)
        if candidate.startswith(self.repo):
            return False
        if self.beside is not None and candidate.startswith(self.beside):
            return True
        if any(candidate.startswith(root) for root in self.roots):
            return False
        return not any(
            candidate.startswith(parent) and candidate[len(parent) :].startswith(".")
            for parent in self.dot_parents
        )


def default_allowed() -> list[str]:
    """The roots any test may touch besides the repository."""
    roots = [tempfile.gettempdir(), sys.prefix, sys.base_prefix, sys.exec_prefix, *SYSTEM_ROOTS]
    roots += [*site.getsitepackages(), site.getusersitepackages()]
    roots += [p for p in sysconfig.get_paths().values() if p]
    corpus = os.environ.get("SHARDWISE_CORPUS")  # the one outside copy a person may name on purpose
    if corpus:
        roots.append(corpus)
    report = os.environ.get("SHARDWISE_GPU_REPORT")  # the GPU tests' measurements (tests/gpu/cuda_support.py)
    if report:
        roots.append(report)
    return roots


class Watcher:
    """The audit hook: collects the outside paths touched since the last ``take``."""

    def __init__(self, boundary: Boundary) -> None:
        self.boundary = boundary
        self.paths: list[str] = []
        self._busy = False

    def __call__(self, event: str, args: tuple) -> None:
        if event not in READ_EVENTS or self._busy or not args:
            return
        path = args[0]
        if not isinstance(path, (str, bytes, os.PathLike)):
            return  # a file descriptor
        self._busy = True
        try:
            text = os.fsdecode(path) if path else "."
            if self.boundary.outside(text):
                self.paths.append(os.path.abspath(text))
        finally:
            self._busy = False

    def take(self) -> list[str]:
        """The outside paths recorded so far, once each; the record starts empty again."""
        taken, self.paths = list(dict.fromkeys(self.paths)), []
        return taken


def install() -> Watcher:
    """Start watching this process (an audit hook cannot be removed: call once)."""
    watcher = Watcher(Boundary(REPO, default_allowed(), dot_entries_of=[Path.home()]))
    sys.addaudithook(watcher)
    return watcher
