"""Hostfile parsing: the MPI-style ``host slots=N`` file that names the machines of a run.

Pure text processing, no I/O beyond :func:`read_hostfile`, so every rule is testable in
microseconds. The format follows DeepSpeed's launcher (spec section 9.2):

* one ``hostname slots=N`` entry per line; the pattern is anchored at the start of the
  line and text after the slot count is ignored (so ``worker-0 slots=4 # rack A``
  works);
* lines starting with ``#`` and blank lines are skipped;
* a host listed twice, a malformed line, or a file with no entries is an error.

Unlike DeepSpeed we also reject ``slots=0`` (a host with no devices cannot take part, and
commenting the line out says the same thing without surprises later on), a slot count with
text glued to it (``slots=4x``), and a second ``slots=`` on a line (``worker-0 slots=2
slots=3``, where DeepSpeed silently takes the first).
"""

from __future__ import annotations

import os
import re

from shardwise.utils.logging import logger

__all__ = ["HOSTFILE_ENTRY_FORM", "parse_hostfile", "read_hostfile"]

# Anchored at the line start; text after the slot count (from the next blank or '#') is ignored,
# except a repeated slots key.
_ENTRY = re.compile(r"^(\S+)\s+slots=(\d+)(?=\s|#|$)")
_SLOTS_KEY = re.compile(r"(?<![\w.-])slots\s*=\s*(\S*)")

HOSTFILE_ENTRY_FORM = "<hostname> slots=<N>   (for example: worker-0 slots=8)"
"""The expected form of one hostfile line, quoted in error messages."""


def parse_hostfile(text: str, source: str = "<hostfile>") -> dict[str, int]:
    """Parse hostfile text into an ordered ``{host: slots}`` mapping.

    Args:
        text: the file's contents.
        source: a name for the text (usually its path), used in error messages.

    Returns:
        Hosts in file order, each with its slot count (>= 1).

    Raises:
        ValueError: for a malformed line, a duplicate host, a repeated ``slots`` key,
            ``slots=0`` or a file without any entries. The message names the source,
            the line number and the offending text.

    Example:
        >>> parse_hostfile("worker-0 slots=4\\n# spare\\nworker-1 slots=4\\n")
        {'worker-0': 4, 'worker-1': 4}
    """
    hosts: dict[str, int] = {}
    first_seen: dict[str, int] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _ENTRY.match(line)
        if match is None:
            raise ValueError(
                f"Hostfile contains a bad entry: {source}:{lineno}: {raw!r}. "
                f"Expected one entry per line in the form {HOSTFILE_ENTRY_FORM}; "
                "use '#' to comment a line out."
            )
        host, slots = match.group(1), int(match.group(2))
        again = _SLOTS_KEY.search(line[match.end() :].split("#", 1)[0])
        if again is not None:
            raise ValueError(
                f"Hostfile entry {source}:{lineno}: {raw!r} gives the key 'slots' twice "
                f"(slots={slots} and slots={again.group(1)}). Give it once, with the host's total slot count: "
                f"'{host} slots=<N>'."
            )
        if host in hosts:
            raise ValueError(
                f"Hostfile contains multiple entries for {host}: {source}:{first_seen[host]} and "
                f"{source}:{lineno}. List each host once with its total slot count."
            )
        if slots == 0:
            raise ValueError(
                f"Hostfile entry {source}:{lineno}: {raw!r} has slots=0; every host needs at least "
                "one slot. Comment the line out with '#' to leave the host out of the run."
            )
        hosts[host] = slots
        first_seen[host] = lineno
    if not hosts:
        raise ValueError(
            f"Hostfile is empty or not formatted correctly: {source} has no entries. "
            f"Expected lines of the form {HOSTFILE_ENTRY_FORM}."
        )
    return hosts


def read_hostfile(path: str | os.PathLike[str], missing_ok: bool = False) -> dict[str, int] | None:
    """Read and parse a hostfile from disk.

    Args:
        path: the hostfile's path.
        missing_ok: when the file does not exist, log DeepSpeed's warning and return
            ``None`` (the caller then runs on local resources only) instead of raising.
            The launcher sets this for its default path (``/job/hostfile``), where a
            missing file is normal; an explicitly named hostfile should be required.

    Returns:
        The parsed ``{host: slots}`` mapping, or ``None`` for a missing file when
        ``missing_ok`` is true.

    Raises:
        FileNotFoundError: the file does not exist and ``missing_ok`` is false.
        ValueError: the contents are malformed (see :func:`parse_hostfile`).

    Example:
        >>> read_hostfile("/nonexistent/hostfile", missing_ok=True) is None
        True
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        if missing_ok:
            logger.warning("Unable to find hostfile %s: training on this machine's local resources only", path)
            return None
        raise FileNotFoundError(
            f"Hostfile {path!r} does not exist. Create it with lines of the form {HOSTFILE_ENTRY_FORM}, "
            "or leave out the hostfile option to run on this machine only."
        )
    with open(path, encoding="utf-8") as handle:
        return parse_hostfile(handle.read(), source=path)
