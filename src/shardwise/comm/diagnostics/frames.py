"""Reading stacks: where a rank is, from its frames (a traceback, a live frame, a faulthandler dump).

Pure helpers (torch is imported only to recognise its error type), unit-tested with made-up paths.
"""

from __future__ import annotations

import re
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Frame",
    "frames_from_frame",
    "frames_from_traceback",
    "is_collective_failure",
    "parse_faulthandler_dump",
    "short_error",
    "summarize_frames",
]


@dataclass(frozen=True)
class Frame:
    """One stack frame: file, line number and function name."""

    path: str
    line: int
    func: str

    def where(self) -> str:
        """``file:line in func`` with the file shortened to its last two parts."""
        parts = self.path.replace("\\", "/").split("/")
        short = "/".join(parts[-2:]) if len(parts) > 1 else self.path
        return f"{short}:{self.line} in {self.func}"


_TORCH_DIST = re.compile(r"[/\\]torch[/\\]distributed[/\\]")

_SHARDWISE_COMM = re.compile(r"[/\\]shardwise[/\\]comm[/\\](collectives|exchange)\.py$")

_LIBRARY = re.compile(r"[/\\](torch|shardwise|runpy|threading|multiprocessing|concurrent)([/\\]|\.py$)")

_PLUMBING_FUNCS = frozenset({"wrapper", "_wrapped", "inner", "decorate_context", "_fn", "__call__"})


def summarize_frames(frames: Sequence[Frame]) -> tuple[str | None, str | None, str | None]:
    """Read a stack (outermost first): the communication call, the user's line, the library's line.

    Returns:
        ``(call, where, via)``: ``call`` is the ``torch.distributed`` function the stack
        is in (e.g. ``"all_reduce"``), or None; ``where`` is the innermost frame outside
        torch, shardwise and the standard library's plumbing (the user's code); ``via`` is
        the innermost shardwise frame, when the call came through the library.

    Example:
        >>> stack = [Frame("/w/train.py", 42, "main"), Frame("/v/torch/distributed/c10d_logger.py", 83, "wrapper"),
        ...          Frame("/v/torch/distributed/distributed_c10d.py", 3252, "all_reduce")]
        >>> summarize_frames(stack)
        ('all_reduce', 'w/train.py:42 in main', None)
    """
    call = None
    for frame in frames:  # outermost torch.distributed function = the API that was called
        if (
            _TORCH_DIST.search(frame.path)
            and frame.func not in _PLUMBING_FUNCS
            and not frame.func.startswith("_")
        ):
            call = frame.func
            break
    user = None
    for index in range(len(frames) - 1, -1, -1):
        path = frames[index].path.replace("\\", "/")
        if not _LIBRARY.search(path) and not path.startswith("<"):
            user = index
            break
    via = None
    # The library frame between the user's line and torch: the part of shardwise that called.
    for index in range(len(frames) - 1, -1 if user is None else user, -1):
        path = frames[index].path.replace("\\", "/")
        if "/shardwise/" in path and not re.search(r"/shardwise/(comm/diagnostics|launcher)/?", path):
            via = frames[index].where()
            break
    return call, None if user is None else frames[user].where(), via


_SOURCE_PREFIX = re.compile(r"\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*")


def short_error(message: str) -> str:
    """The first line of an error message without C++ source locations.

    Example:
        >>> short_error("[/src/gloo/unbound_buffer.cc:78] Timed out waiting 3000ms\\nmore")
        'Timed out waiting 3000ms'
    """
    lines = message.strip().splitlines()
    return _SOURCE_PREFIX.sub("", lines[0]).strip() if lines else ""


def frames_from_traceback(tb: Any) -> list[Frame]:
    """The frames of a traceback object, outermost first.

    Source lines are not read: a failing rank builds its status from this before others
    ask where it is, and reading files (``traceback.extract_tb`` does) is slow on a loaded
    machine.
    """
    return [Frame(f.f_code.co_filename, line or 0, f.f_code.co_name) for f, line in traceback.walk_tb(tb)]


def frames_from_frame(frame: Any) -> list[Frame]:
    """The frames of a live stack (e.g. another thread's current frame), outermost first."""
    frames = [
        Frame(f.f_code.co_filename, line or 0, f.f_code.co_name) for f, line in traceback.walk_stack(frame)
    ]
    return frames[::-1]  # walk_stack goes innermost first


_FH_FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


def parse_faulthandler_dump(text: str) -> list[Frame]:
    """The main thread's frames (outermost first) from a ``faulthandler`` dump.

    faulthandler lists the most recent call first, one block per thread; the block marked
    ``Current thread`` or the last block (the main thread is listed last) is used.

    Example:
        >>> dump = 'Current thread 0x1 (most recent call first):\\n  File "/t/x.py", line 9 in g\\n' \\
        ...        '  File "/t/x.py", line 3 in <module>\\n'
        >>> [f.line for f in parse_faulthandler_dump(dump)]
        [3, 9]
    """
    blocks: list[tuple[bool, list[Frame]]] = []
    for line in text.splitlines():
        if line.startswith(("Thread ", "Current thread ")):
            blocks.append((line.startswith("Current thread "), []))
            continue
        match = _FH_FRAME.match(line)
        if match:
            if not blocks:
                blocks.append((True, []))
            blocks[-1][1].append(Frame(match["path"], int(match["line"]), match["func"]))
    if not blocks:
        return []
    chosen = next((frames for current, frames in blocks if current), blocks[-1][1])
    return list(reversed(chosen))


def is_collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` came out of a collective (torch.distributed, or a wait in shardwise's comm)."""
    try:
        import torch.distributed as dist

        if isinstance(exc, dist.DistError):
            return True
    except Exception:
        pass
    # torch.distributed's Python API, or shardwise's waits for asynchronous communication
    # (their errors come from C++ Work.wait(), with no torch.distributed frame above them)
    return any(
        _TORCH_DIST.search(f.path) or _SHARDWISE_COMM.search(f.path)
        for f in frames_from_traceback(exc.__traceback__)
    )
