"""torch's flight recorder: switching it on, reading this rank's record, and summarising it.

The recorder is a C++ ring buffer of each rank's collectives with their sequence numbers, so a
rank can say "I am in all_reduce #57 of group 0". Reading it is an optional aid: no record is
not an error.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

__all__ = [
    "FLIGHT_RECORDER_ENTRIES",
    "enable_flight_recorder",
    "flight_recorder_available",
    "read_flight_record",
    "summarize_flight_record",
]


FLIGHT_RECORDER_ENTRIES = 2000
"""Collectives remembered per rank when we switch the flight recorder on."""

_RECENT = 16  # collectives per group kept in a status, to find what a rank did at a given sequence number


def enable_flight_recorder(environ: Any = None) -> bool:
    """Switch torch's flight recorder on for process groups created from now on.

    Leaves an explicit ``TORCH_FR_BUFFER_SIZE`` / ``TORCH_NCCL_TRACE_BUFFER_SIZE`` alone, and
    does nothing with ``SHARDWISE_FLIGHT_RECORDER=0``. Returns whether it is on.

    Example:
        >>> env = {}
        >>> enable_flight_recorder(env), env["TORCH_FR_BUFFER_SIZE"]
        (True, '2000')
    """
    env = os.environ if environ is None else environ
    if env.get("SHARDWISE_FLIGHT_RECORDER", "1").strip() == "0":
        return False
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        if env.get(name, "").strip():
            return env[name].strip() not in ("0", "")
    env["TORCH_FR_BUFFER_SIZE"] = str(FLIGHT_RECORDER_ENTRIES)
    return True


def flight_recorder_available() -> bool:
    """Whether this torch build can dump its flight recorder (for ``shardwise report``)."""
    try:
        from torch._C import _distributed_c10d as c10d
    except Exception:  # no torch.distributed in this build
        return False
    return hasattr(c10d, "_dump_fr_trace_json")


def read_flight_record() -> dict[str, Any]:
    """This rank's flight record as torch dumps it (``{}`` when there is none)."""
    try:
        from torch._C import _distributed_c10d as c10d

        dump = getattr(c10d, "_dump_fr_trace_json", None)
        if dump is None:
            return {}
        return json.loads(dump(True, False))
    except Exception:  # the recorder is an optional aid; no record is not an error
        return {}


def summarize_flight_record(record: Mapping[str, Any]) -> dict[str, Any]:
    """Reduce a flight-recorder dump to what a diagnosis needs.

    Returns:
        ``{"active": [{"pg", "seq", "op"}], "last": {pg: {"seq", "op"}}, "enqueued": {pg: seq},
        "recent": {pg: [{"seq", "op"}]}}``: collectives not finished, the last collective per
        process group, the last sequence number issued per group, and the most recent
        collectives per group.

    Example:
        >>> fr = {"entries": [{"process_group": ["0", "default_pg"], "collective_seq_id": 7,
        ...                    "profiling_name": "gloo:all_reduce", "retired": False, "state": "scheduled"}],
        ...       "pg_status": {"0": {"last_enqueued_collective": "7"}}}
        >>> summarize_flight_record(fr)["active"]
        [{'pg': '0', 'seq': 7, 'op': 'all_reduce'}]
        >>> summarize_flight_record(fr)["enqueued"]
        {'0': 7}
    """
    active: list[dict[str, Any]] = []
    last: dict[str, dict[str, Any]] = {}
    recent: dict[str, list[dict[str, Any]]] = {}
    for entry in record.get("entries", []) or []:
        if entry.get("is_p2p"):
            continue
        group = entry.get("process_group") or ["?"]
        pg = str(group[0])
        op = str(entry.get("profiling_name", "?")).split(":")[-1]
        seq = int(entry.get("collective_seq_id", 0) or 0)
        item: dict[str, Any] = {"pg": pg, "seq": seq, "op": op}
        if not entry.get("retired", False) and entry.get("state") != "completed":
            active.append(item)
        if seq >= last.get(pg, {}).get("seq", -1):
            last[pg] = {"seq": seq, "op": op}
        recent.setdefault(pg, []).append({"seq": seq, "op": op})
    enqueued: dict[str, int] = {}
    for pg, status in (record.get("pg_status", {}) or {}).items():
        raw = str(status.get("last_enqueued_collective", "-1"))
        if raw.lstrip("-").isdigit() and int(raw) >= 0:
            enqueued[str(pg)] = int(raw)
    for pg, latest in last.items():
        enqueued[pg] = max(enqueued.get(pg, 0), int(latest["seq"]))
    recent = {pg: items[-_RECENT:] for pg, items in recent.items()}
    return {"active": active, "last": last, "enqueued": enqueued, "recent": recent}
