"""``deepspeed.launcher.runner`` and ``deepspeed.launcher.multinode_runner``: DeepSpeed's launcher functions
with DeepSpeed's signatures, answered by shardwise's launcher (:mod:`shardwise.launcher`).

``main(args=None)`` runs the ``deepspeed`` command line (a bad launch raises, as DeepSpeed's does);
``parse_resource_filter``/``_parse_hostfile``/``fetch_hostfile`` are the hostfile and include/exclude
rules the launcher plans with; :class:`MultiNodeRunner` is the base class DeepSpeed's multi-node
backends (and users' own) derive from.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from shardwise.compat.constants import DEEPSPEED_ENVIRONMENT_NAME
from shardwise.launcher.command import build_parser
from shardwise.launcher.command import main as _launch
from shardwise.launcher.hostfile import parse_hostfile, read_hostfile
from shardwise.launcher.resources import encode_world_info, filter_resources

__all__ = [
    "DEEPSPEED_ENVIRONMENT_NAME",
    "MultiNodeRunner",
    "_parse_hostfile",
    "encode_world_info",
    "fetch_hostfile",
    "main",
    "parse_args",
    "parse_resource_filter",
]


def parse_args(args: Sequence[str] | None = None) -> argparse.Namespace:
    """The ``deepspeed`` command line's arguments (shardwise's launcher parser, DeepSpeed's option names)."""
    return build_parser("deepspeed").parse_args(sys.argv[1:] if args is None else list(args))


def main(args: Sequence[str] | None = None) -> int:
    """Run ``deepspeed <args>``; returns the exit code. A bad launch raises ``ValueError`` (as DeepSpeed's)."""
    return _launch(None if args is None else list(args), prog="deepspeed", raise_errors=True)


def _parse_hostfile(hostfile_lines: Iterable[str]) -> dict[str, int]:
    """``{host: slots}`` from hostfile lines; a malformed, duplicate or empty hostfile raises ``ValueError``."""
    return parse_hostfile("\n".join(hostfile_lines))


def fetch_hostfile(hostfile_path: str) -> dict[str, int] | None:
    """The hostfile at ``hostfile_path`` as ``{host: slots}``, or ``None`` when there is no such file."""
    return read_hostfile(hostfile_path, missing_ok=True)


def parse_resource_filter(
    host_info: Mapping[str, Any], include_str: str = "", exclude_str: str = ""
) -> dict[str, list[int]]:
    """``host_info`` (``{host: [slots]}``) after ``--include``/``--exclude`` (``host[:slot,...][@...]``);
    hosts left with no slot are dropped. Both filters, an unknown host or slot raise ``ValueError``."""
    return filter_resources(host_info, include_str, exclude_str)


_NEEDS_QUOTES = re.compile(r"[^\w@%+=:,./-]")


class MultiNodeRunner(ABC):
    """A multi-node launch backend (pdsh, OpenMPI, SLURM, ...): DeepSpeed's base class for them.

    ``args`` is the parsed command line (``user_script``, ``user_args``); ``world_info_base64`` the
    encoded ``{host: slots}``. Subclasses say whether their tool exists and build its command.
    """

    def __init__(self, args: Any, world_info_base64: str) -> None:
        self.args = args
        self.validate_args()
        self.user_arguments = self.parse_user_args()
        self.user_script = args.user_script
        self.world_info_base64 = world_info_base64
        self.exports: dict[str, str] = {}

    @abstractmethod
    def backend_exists(self) -> bool:
        """Whether the backend's tool is installed."""

    @abstractmethod
    def get_cmd(self, environment: dict[str, str], active_resources: Mapping[str, list[int]]) -> list[str]:
        """The command that starts every node's processes."""

    def add_export(self, key: str, var: str) -> None:
        """Export ``key=var`` to the nodes; a value with shell-special characters is double-quoted."""
        var = str(var).strip()
        self.exports[key.strip()] = f'"{var}"' if _NEEDS_QUOTES.search(var) else var

    def parse_user_args(self) -> list[str]:
        """The user script's arguments, each shell-quoted for the remote command line."""
        return [shlex.quote(arg) for arg in self.args.user_args]

    def validate_args(self) -> None:  # noqa: B027 - optional hook, most backends check nothing
        """Check backend-specific arguments (none by default)."""

    @property
    def name(self) -> str:
        """The backend's name: the class name."""
        return self.__class__.__name__
