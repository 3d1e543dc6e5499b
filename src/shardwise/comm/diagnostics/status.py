"""Status records: one rank's answer to "where are you?", and what it says about a sync point.

A status is a JSON-ready dict (it travels through the job's store): ``state`` ("running",
"failed" or "exited"), ``call``/``where``/``via`` from :mod:`.frames`, ``arrival`` (the sync
point it waits at), ``error``, and ``fr`` (its flight record, summarised). Pure helpers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["describe_status", "rank_ranges", "why_cannot_arrive"]


def describe_status(status: Mapping[str, Any] | None) -> str:
    """One line saying where a rank is, from its status dict (None: it did not answer).

    Example:
        >>> describe_status({"state": "running", "call": "barrier", "where": "t.py:9 in main",
        ...                  "fr": {"active": [{"pg": "0", "seq": 3, "op": "barrier"}]}})
        'waiting in barrier #3 (group 0) at t.py:9 in main'

        A rank asked just as its own collective timed out: the record is retired, but the
        main thread is still in the call, and the newest record of its group names it.

        >>> describe_status({"state": "running", "call": "all_reduce", "where": "t.py:8 in main",
        ...                  "fr": {"active": [], "last": {"0": {"seq": 2, "op": "all_reduce"}}}})
        'waiting in all_reduce #2 (group 0) at t.py:8 in main'
    """
    if status is None:
        return "did not answer (the process is gone, or hung while holding Python's GIL)"
    state = status.get("state")
    if state == "exited" and not status.get("error"):
        return "had already exited"
    fr = status.get("fr") or {}
    active = fr.get("active") or []
    op = status.get("call")
    finished = [(pg, item) for pg, item in (fr.get("last") or {}).items() if op and item["op"] == op]
    if active:
        newest = active[-1]
        what = f"{newest['op']} #{newest['seq']} (group {newest['pg']})"
    elif finished:
        # The collective the main thread is in, already retired by its error (the rank
        # failed, or is about to report its own timeout).
        pg, item = finished[-1]
        what = f"{op} #{item['seq']} (group {pg})"
    elif op:
        what = op
    else:
        what = None
    at = f" at {status['where']}" if status.get("where") else ""
    via = f" via {status['via']}" if status.get("via") and status.get("via") != status.get("where") else ""
    if state in ("failed", "exited"):
        head = f"failed in {what}" if what else "failed"
        head = f"had already exited after it {head}" if state == "exited" else head
        return f"{head}{at}: {status.get('error', 'an error')}"
    if status.get("arrival"):
        arrival = status["arrival"]
        return f"waiting for the other ranks at {arrival['op']} (sync point #{arrival['seq']}){at}"
    if what:
        return f"waiting in {what}{at}{via}"
    return f"running outside any collective{at}{via}"


def why_cannot_arrive(
    status: Mapping[str, Any] | None,
    my_enqueued: Mapping[str, int],
    my_arrival: Mapping[str, Any],
) -> str | None:
    """Why a rank that did not reach my sync point never will, or None if it still may.

    A missing rank can never arrive when it has exited, failed, waits at a different sync
    point, or waits in a collective that this rank has not issued (it needs this rank,
    which is blocked here: a deadlock).

    Args:
        status: the missing rank's status (None: no answer yet).
        my_enqueued: my last issued collective sequence number per process group.
        my_arrival: ``{"op", "seq"}`` of the sync point I am waiting at.

    Example:
        >>> st = {"state": "running", "fr": {"active": [{"pg": "0", "seq": 12, "op": "all_reduce"}]}}
        >>> why_cannot_arrive(st, {"0": 11}, {"op": "save_checkpoint", "seq": 1})
        'it is waiting in all_reduce #12 (group 0), a collective this rank has not called'
    """
    if status is None:
        return None
    state = status.get("state")
    if state == "exited":
        return "it had already exited"
    if state == "failed":
        return f"it failed: {status.get('error', 'an error')}"
    arrival = status.get("arrival")
    if arrival and (arrival.get("op") != my_arrival.get("op") or arrival.get("seq") != my_arrival.get("seq")):
        return f"it is waiting at a different sync point: {arrival.get('op')} #{arrival.get('seq')}"
    fr = status.get("fr") or {}
    active = fr.get("active") or []
    for item in active:
        pg = item["pg"]
        if pg in my_enqueued and item["seq"] > my_enqueued[pg]:
            return f"it is waiting in {item['op']} #{item['seq']} (group {pg}), a collective this rank has not called"
    if not active and not fr.get("enqueued") and status.get("call") and not arrival:
        # No flight recorder: the stack alone says it is blocked in a collective.
        return f"it is waiting in {status['call']}, a collective this rank has not called"
    return None


def rank_ranges(ranks: Iterable[int]) -> str:
    """Compress sorted ranks into ranges.

    Example:
        >>> rank_ranges([0, 1, 2, 5, 7, 8])
        '0-2, 5, 7-8'
    """
    out: list[str] = []
    ordered = sorted(set(ranks))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        out.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ", ".join(out)
