"""Write, describe and refuse the ``deepspeed`` compatibility package (``shardwise compat ...``).

The package is two files and a dist-info: ``deepspeed/__init__.py`` (a docstring and one call to
:func:`shardwise.compat.forwarding.activate`), a ``deepspeed`` console script that runs shardwise's
launcher, and ``deepspeed-<DeepSpeed version>+shardwise.<version>.dist-info`` (METADATA, RECORD,
INSTALLER) so ``importlib.metadata`` finds it, version checks pass and ``pip uninstall deepspeed``
removes every file. A real DeepSpeed in the target is never overwritten.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from shardwise import __version__
from shardwise.compat.table import DEEPSPEED_VERSION

MARKER = "shardwise-compat"
"""The INSTALLER line that tells our package from a real DeepSpeed."""

PACKAGE_VERSION = f"{DEEPSPEED_VERSION}+shardwise.{__version__}"

INIT_SOURCE = '''"""DeepSpeed's import paths forwarded to shardwise (written by `shardwise compat install-deepspeed`).

This package holds no logic: every name is looked up in shardwise.compat.table.
Remove it with `pip uninstall deepspeed`.
"""

from shardwise.compat.forwarding import activate

activate(__name__)
'''

SCRIPT_SOURCE = """#!{python}
# `deepspeed` command written by `shardwise compat install-deepspeed`: runs shardwise's launcher.
import sys

from shardwise.launcher.command import main

sys.exit(main(sys.argv[1:]))
"""


class CompatInstallError(RuntimeError):
    """The compatibility package cannot be written (a real DeepSpeed is there, or the target is wrong)."""


@dataclass(frozen=True)
class CompatStatus:
    """What ``import deepspeed`` finds: nothing, shardwise's package (and its version), or a real DeepSpeed."""

    kind: str  # "none" | "shardwise" | "deepspeed"
    version: str | None
    location: str | None

    def describe(self) -> str:
        """One line for ``shardwise compat status``."""
        if self.kind == "none":
            return "no 'deepspeed' package is installed; `shardwise compat install-deepspeed` writes one"
        if self.kind == "shardwise":
            return f"deepspeed {self.version} (shardwise's compatibility package) at {self.location}"
        return (
            f"a real DeepSpeed {self.version} is installed at {self.location}; shardwise does not replace it"
        )


def _site_dir(target: str | os.PathLike[str] | None) -> Path:
    return Path(target) if target is not None else Path(sysconfig.get_paths()["purelib"])


def _script_dir(target: str | os.PathLike[str] | None) -> Path:
    return Path(target) / "bin" if target is not None else Path(sysconfig.get_paths()["scripts"])


def status(target: str | os.PathLike[str] | None = None) -> CompatStatus:
    """What a ``deepspeed`` distribution in ``target`` (default: this interpreter's paths) is."""
    paths = [str(_site_dir(target))] if target is not None else sys.path
    for dist in importlib.metadata.distributions(name="deepspeed", path=paths):
        installer = (dist.read_text("INSTALLER") or "").strip()
        kind = "shardwise" if installer == MARKER else "deepspeed"
        return CompatStatus(kind, dist.version, str(dist.locate_file("")))
    return CompatStatus("none", None, None)


def _record_line(site: Path, path: Path) -> str:
    data = path.read_bytes()
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{os.path.relpath(path, site)},sha256={digest},{len(data)}"


def install(target: str | os.PathLike[str] | None = None) -> list[Path]:
    """Write the package, its console script and dist-info into ``target`` (default: site-packages).

    Returns the files written. Re-running replaces an earlier shardwise package.

    Raises:
        CompatInstallError: a real DeepSpeed is installed there.
    """
    current = status(target)
    if current.kind == "deepspeed":
        raise CompatInstallError(
            f"{current.describe()}: uninstall it first (`pip uninstall deepspeed`) to use shardwise in its place, "
            "or keep it and `import shardwise as deepspeed` in your own scripts"
        )
    if current.kind == "shardwise":
        uninstall(target)
    site, scripts = _site_dir(target), _script_dir(target)
    package = site / "deepspeed"
    dist_info = site / f"deepspeed-{PACKAGE_VERSION}.dist-info"
    package.mkdir(parents=True, exist_ok=True)
    dist_info.mkdir(parents=True, exist_ok=True)
    scripts.mkdir(parents=True, exist_ok=True)
    files = [package / "__init__.py", scripts / "deepspeed", dist_info / "METADATA", dist_info / "INSTALLER"]
    files[0].write_text(INIT_SOURCE)
    files[1].write_text(SCRIPT_SOURCE.format(python=sys.executable))
    files[1].chmod(0o755)
    files[2].write_text(
        f"Metadata-Version: 2.1\nName: deepspeed\nVersion: {PACKAGE_VERSION}\n"
        f"Summary: DeepSpeed's import paths forwarded to shardwise {__version__} (no DeepSpeed code)\n"
        "Requires-Dist: shardwise\n"
    )
    files[3].write_text(MARKER + "\n")
    record = dist_info / "RECORD"
    lines = [_record_line(site, path) for path in files]
    record.write_text("\n".join([*lines, f"{os.path.relpath(record, site)},,"]) + "\n")
    return [*files, record]


def uninstall(target: str | os.PathLike[str] | None = None) -> list[Path]:
    """Remove shardwise's package (every file its RECORD lists); returns what was removed.

    Raises:
        CompatInstallError: the ``deepspeed`` there is a real DeepSpeed.
    """
    current = status(target)
    if current.kind == "none":
        return []
    if current.kind == "deepspeed":
        raise CompatInstallError(f"{current.describe()}: not removing it (it is not shardwise's)")
    site = _site_dir(target)
    dist_info = site / f"deepspeed-{current.version}.dist-info"
    removed = []
    for line in (dist_info / "RECORD").read_text().splitlines():
        path = (site / line.split(",")[0]).resolve()
        if path.exists():
            path.unlink()
            removed.append(path)
    for folder in (site / "deepspeed" / "__pycache__", site / "deepspeed", dist_info):
        if folder.is_dir():
            for leftover in folder.iterdir():
                leftover.unlink()
            folder.rmdir()
    return removed
