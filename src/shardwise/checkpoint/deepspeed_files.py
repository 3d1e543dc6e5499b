"""DeepSpeed's ``torch.save`` files, read without DeepSpeed: safe unpickling and small decoders.

DeepSpeed's pickles name a few of its own classes (the ZeRO stage enum, ``fragment_address``,
loss scalers). :func:`load_file` reads them with ``weights_only=True`` and a small stand-in class
(:class:`ForeignObject`) per DeepSpeed name, memory-mapped so only the pages used are read.
Used by the native importer (:mod:`~shardwise.checkpoint.deepspeed_import`) and the universal
reader (:mod:`~shardwise.checkpoint.universal_read`).

Example:
    >>> # state = load_file(Path("global_step2/mp_rank_00_model_states.pt"))
"""

from __future__ import annotations

import pickletools
import zipfile
from pathlib import Path
from typing import Any

import torch


class ForeignObject:
    """Stands in for a DeepSpeed class while unpickling: keeps constructor args and state."""

    args: tuple[Any, ...] = ()
    state: Any = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs = args, kwargs

    def __setstate__(self, state: object) -> None:
        self.state = state

    def get(self, name: str, position: int | None = None) -> Any:
        """An attribute from the pickled state, or a positional constructor argument."""
        if isinstance(self.state, dict) and name in self.state:
            return self.state[name]
        if position is not None and position < len(self.args):
            return self.args[position]
        raise KeyError(f"{type(self).__name__} has no {name!r}")


def _foreign_globals(path: Path) -> set[str]:
    """``module.Name`` of every DeepSpeed global a ``torch.save`` file's pickle refers to."""
    with zipfile.ZipFile(path) as archive:
        name = next(n for n in archive.namelist() if n.endswith("data.pkl"))
        data = archive.read(name)
    found: set[str] = set()
    strings: list[str] = []
    for op, arg, _ in pickletools.genops(data):
        if op.name == "GLOBAL":
            found.add(str(arg).replace(" ", "."))
        elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
            found.add(f"{strings[-2]}.{strings[-1]}")
        if isinstance(arg, str):
            strings.append(arg)
    return {g for g in found if g.startswith("deepspeed.")}


def load_file(path: Path) -> Any:
    """``torch.load`` a DeepSpeed file safely (weights-only, stand-ins for DeepSpeed classes, mmap)."""
    stubs = [
        (type(qual.rsplit(".", 1)[1], (ForeignObject,), {"__module__": "shardwise.foreign"}), qual)
        for qual in sorted(_foreign_globals(path))
    ]
    with torch.serialization.safe_globals(stubs):  # type: ignore[arg-type]
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def _plain(value: object) -> Any:
    """The number behind a stand-in enum (``ZeroStageEnum(2)`` -> 2)."""
    if isinstance(value, ForeignObject) and value.args:
        return value.args[0]
    return value


def _fragment(value: Any) -> tuple[int, int]:
    """``(start, numel)`` of a ``fragment_address`` (a namedtuple ``(numel, start)``)."""
    if isinstance(value, ForeignObject):
        return int(value.get("start", 1)), int(value.get("numel", 0))
    numel, start = value
    return int(start), int(numel)


def _rank_of(path: Path) -> int:
    parts = path.name.split("_")
    return int(parts[parts.index("rank") + 1]) if "rank" in parts else 0

