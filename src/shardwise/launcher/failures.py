"""Failure records: what each rank leaves behind when it fails, and the launcher's summary.

When one rank fails, torchrun stops the others, and every one of them prints something:
the real error scrolls away among "connection closed by peer" messages and signal notices.
So each rank's worker writes a small JSON record into the run directory
(``SHARDWISE_RUN_DIR``, created by the launcher) when its script fails, and a stack dump
(``faulthandler``) when it is stopped by a signal. After the launch the launcher reads them
and prints, first, the rank that failed first with its traceback (and the hang diagnosis
if a collective failed), then which ranks failed afterwards and where the stopped ranks
were. The exit code is the first failing rank's.

Record file: ``rank-<RANK>.json`` with ``rank``, ``local_rank``, ``node_rank``, ``host``,
``pid``, ``exitcode``, ``time`` (epoch seconds), ``error`` (one line), ``traceback`` and
``diagnosis`` (text or null). Stack file: ``rank-<RANK>.stack``.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from shardwise.comm.diagnostics import parse_faulthandler_dump, rank_ranges, summarize_frames

__all__ = [
    "RUN_DIR_VAR",
    "FailureRecord",
    "format_failure_summary",
    "read_records",
    "read_stopped_locations",
    "write_record",
]

RUN_DIR_VAR = "SHARDWISE_RUN_DIR"
"""Environment variable naming the directory where ranks leave failure records."""


@dataclass(frozen=True)
class FailureRecord:
    """One rank's failure as the worker recorded it."""

    rank: int
    exitcode: int
    time: float
    error: str
    traceback: str = ""
    diagnosis: str | None = None
    local_rank: int | None = None
    node_rank: int | None = None
    host: str = ""
    pid: int = 0

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FailureRecord:
        """Build from the JSON a worker wrote (unknown keys are ignored)."""
        return cls(
            rank=int(data["rank"]),
            exitcode=int(data["exitcode"]),
            time=float(data["time"]),
            error=str(data.get("error", "")),
            traceback=str(data.get("traceback") or ""),
            diagnosis=data.get("diagnosis"),
            local_rank=data.get("local_rank"),
            node_rank=data.get("node_rank"),
            host=str(data.get("host", "")),
            pid=int(data.get("pid", 0) or 0),
        )

    def label(self) -> str:
        """``rank 3 (node 1 host-b, local rank 1)``."""
        parts = []
        if self.node_rank is not None:
            parts.append(f"node {self.node_rank}" + (f" {self.host}" if self.host else ""))
        if self.local_rank is not None:
            parts.append(f"local rank {self.local_rank}")
        return f"rank {self.rank}" + (f" ({', '.join(parts)})" if parts else "")


def write_record(run_dir: str, record: Mapping[str, object]) -> str:
    """Write a rank's record atomically (temp file + rename); returns its path."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, f"rank-{record['rank']}.json")
    fd, tmp = tempfile.mkstemp(dir=run_dir, prefix=".rank-", suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        json.dump(dict(record), handle)
    os.replace(tmp, path)
    return path


def read_records(run_dir: str) -> list[FailureRecord]:
    """Every failure record in ``run_dir``, earliest first (unreadable files are skipped)."""
    records: list[FailureRecord] = []
    if not os.path.isdir(run_dir):
        return records
    for name in os.listdir(run_dir):
        if not (name.startswith("rank-") and name.endswith(".json")):
            continue
        try:
            with open(os.path.join(run_dir, name), encoding="utf-8") as handle:
                records.append(FailureRecord.from_dict(json.load(handle)))
        except (OSError, ValueError, KeyError):
            continue
    return sorted(records, key=lambda r: (r.time, r.rank))


def read_stopped_locations(run_dir: str) -> dict[int, str]:
    """``{rank: where}`` for ranks that left a stack dump when they were stopped by a signal."""
    out: dict[int, str] = {}
    if not os.path.isdir(run_dir):
        return out
    for name in os.listdir(run_dir):
        if not (name.startswith("rank-") and name.endswith(".stack")):
            continue
        rank_text = name[len("rank-") : -len(".stack")]
        try:
            with open(os.path.join(run_dir, name), encoding="utf-8", errors="replace") as handle:
                text = handle.read()
        except OSError:
            continue
        frames = parse_faulthandler_dump(text)
        if not frames or not rank_text.isdigit():
            continue
        call, where, via = summarize_frames(frames)
        if call:
            out[int(rank_text)] = (
                f"in {call}" + (f" at {where}" if where else "") + (f" via {via}" if via else "")
            )
        else:
            out[int(rank_text)] = f"at {where or frames[-1].where()}" + (f" via {via}" if via else "")
    return out


def _short(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def format_failure_summary(
    records: Sequence[FailureRecord],
    stopped: Mapping[int, str] | None = None,
    agent_codes: Mapping[str, int] | None = None,
) -> str:
    """The launcher's closing report: the first failure in full, then the rest in a line each.

    Args:
        records: failure records, earliest first.
        stopped: where ranks that were stopped by a signal were (from their stack dumps).
        agent_codes: exit codes of the node agents, used when no rank left a record.

    Example:
        >>> rec = FailureRecord(rank=1, exitcode=3, time=1.0, error="ValueError: boom",
        ...                     traceback="Traceback ...\\nValueError: boom\\n", local_rank=1, node_rank=0)
        >>> print(format_failure_summary([rec], {0: "in all_reduce at t.py:8 in main"}))
        ======== shardwise: rank 1 (node 0, local rank 1) failed first (exit code 3) ========
        Traceback ...
        ValueError: boom
        Stopped by the launcher after that failure: rank 0 in all_reduce at t.py:8 in main.
    """
    lines: list[str] = []
    stopped = dict(stopped or {})
    if records:
        first = records[0]
        lines.append(
            f"======== shardwise: {first.label()} failed first (exit code {first.exitcode}) ========"
        )
        lines.append(first.traceback.rstrip() or first.error)
        # Only the first failure's diagnosis: later ones describe the consequences.
        if first.diagnosis:
            lines.append("---- hang diagnosis ----")
            lines.append(first.diagnosis.rstrip())
        later = records[1:]
        if later:
            lines.append(
                "Failed afterwards (usually a consequence of the first failure): "
                + "; ".join(f"{r.label()}: {_short(r.error)}" for r in later)
                + "."
            )
        for record in records:
            stopped.pop(record.rank, None)
    else:
        codes = {host: code for host, code in (agent_codes or {}).items() if code != 0}
        lines.append(
            "======== shardwise: the launch failed; no rank left an error record ("
            + ", ".join(f"node {host} exit code {code}" for host, code in codes.items())
            + "). The output above shows the error. ========"
        )
    if stopped:
        by_where: dict[str, list[int]] = {}
        for rank, where in sorted(stopped.items()):
            by_where.setdefault(where, []).append(rank)
        parts = [
            f"{'rank' if len(r) == 1 else 'ranks'} {rank_ranges(r)} {where}" for where, r in by_where.items()
        ]
        lines.append("Stopped by the launcher after that failure: " + "; ".join(parts) + ".")
    return "\n".join(lines)
