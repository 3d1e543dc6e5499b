"""Hang diagnosis: which ranks did not arrive, and where each one is instead.

A distributed job that "hangs" is almost always one rank waiting in a collective that
another rank never calls (it skipped it, called a different one, raised, or is stuck in
I/O). torch's own error says only "timed out waiting for recv". This module makes the
failure say *who* and *where*, at no cost on the hot path:

* torch's **flight recorder** is switched on (``TORCH_FR_BUFFER_SIZE``, unless the user set
  it or ``SHARDWISE_FLIGHT_RECORDER=0``): a C++ ring buffer of each rank's collectives
  with their sequence numbers, so a rank can say "I am in all_reduce #57 of group 0".
* every rank runs a **status responder**: a daemon thread blocked on a queue in the job's
  TCP store (one extra store connection, no polling). Asked, it answers with its
  flight-recorder state and the Python stack of its main thread, which works while the
  main thread is blocked in a collective or busy elsewhere.
* when a collective fails (a timeout, a peer that died), :func:`diagnose_exception` asks
  every rank where it is and builds a report that names the ranks that did not arrive and
  the operation each is waiting in. ``init_distributed`` installs an excepthook that logs
  it; the shardwise launcher's worker puts it into the failure summary.
* :func:`check_all_ranks_arrive` is a sync point for collective *entry points* such as
  ``save_checkpoint``: when a rank is missing it asks where that rank is, and fails at once
  when it can never arrive (it exited, it waits at another sync point, or it waits in a
  collective that needs this rank), instead of hanging until the timeout.

The helpers that turn stacks, flight-recorder records and statuses into text are pure and
unit-tested; torch is imported only inside the functions that talk to a process group.

How ``save_checkpoint`` should use it (the subset-of-ranks guard)::

    from shardwise.comm.diagnostics import check_all_ranks_arrive
    check_all_ranks_arrive("save_checkpoint")  # first line, before any collective

so ``if rank == 0: engine.save_checkpoint(...)`` fails within seconds with "rank 1 never
called save_checkpoint: it is waiting in all_reduce #412 at train.py:88" instead of
hanging every rank until the collective timeout.

The module is longer than most (about 850 lines, half of it docstrings and examples): the
pure report helpers and the runtime that feeds them change together, and splitting them
would spread one status format over two files.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import socket
import sys
import threading
import time
import traceback
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from shardwise.utils.logging import logger

__all__ = [
    "FLIGHT_RECORDER_ENTRIES",
    "Frame",
    "RanksDidNotArriveError",
    "check_all_ranks_arrive",
    "describe_status",
    "diagnose_exception",
    "enable_flight_recorder",
    "format_hang_report",
    "frames_from_traceback",
    "install",
    "is_installed",
    "parse_faulthandler_dump",
    "rank_ranges",
    "short_error",
    "summarize_flight_record",
    "summarize_frames",
    "uninstall",
    "why_cannot_arrive",
]

FLIGHT_RECORDER_ENTRIES = 2000
"""Collectives remembered per rank when we switch the flight recorder on."""

_KEY = "shardwise/diag"
_STOP = b"__stop__"
# Grace for other ranks' answers: they answer from a thread within milliseconds when alive.
_ANSWER_GRACE_S = 5.0
_EVERY_RANK_DIAGNOSES = 16  # up to this world size every failing rank asks every rank
_RECENT = 16  # collectives per group kept in a status, to find what a rank did at a given sequence number


class RanksDidNotArriveError(RuntimeError):
    """Some ranks did not reach a point every rank must reach (e.g. ``save_checkpoint``).

    Attributes:
        op_name: the sync point.
        missing: the ranks that did not arrive.
        report: the multi-line diagnosis (also the exception message).
    """

    def __init__(self, op_name: str, missing: list[int], report: str) -> None:
        super().__init__(report)
        self.op_name = op_name
        self.missing = missing
        self.report = report


# --------------------------------------------------------------------------------------
# Pure helpers: stacks, flight-recorder records, statuses, reports.
# --------------------------------------------------------------------------------------


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


def _frames_from_frame(frame: Any) -> list[Frame]:
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


def _not_arrived_reason(status: Mapping[str, Any] | None, pg: str, seq: int, op: str) -> str | None:
    """Why a rank is not in collective ``op #seq`` of group ``pg``; None if it is (or was) in it."""
    if status is None:
        return "no answer"
    fr = status.get("fr") or {}
    exited = status.get("state") == "exited"
    if not fr.get("enqueued") and not fr.get("recent"):
        # no flight record: cannot tell (the locations above still show where it is)
        return "it had already exited" if exited else None
    at_seq = [item for item in (fr.get("recent") or {}).get(pg, []) if item["seq"] == seq]
    if at_seq:
        if at_seq[-1]["op"] == op:
            return None
        return (
            f"it called {at_seq[-1]['op']} as collective #{seq}: the ranks called different collectives, so "
            "one of them skipped or added a collective"
        )
    if (fr.get("enqueued") or {}).get(pg, -1) < seq:
        if exited:
            return "it had already exited"
        return f"it has not called it; it is at {status.get('where') or 'an unknown place'}"
    return None


def format_hang_report(
    headline: str,
    me: int,
    statuses: Mapping[int, Mapping[str, Any] | None],
    reference: Mapping[str, Any] | None = None,
) -> str:
    """The multi-line diagnosis: a headline, where every rank is, and who did not arrive.

    Args:
        headline: what failed on this rank, e.g. "all_reduce timed out on rank 0".
        me: this rank.
        statuses: every rank's status (this rank's included), None for no answer.
        reference: the collective this rank is stuck in, ``{"pg", "seq", "op"}``; ranks not
            in that same collective are listed as not arrived.

    Example:
        >>> sts = {0: {"state": "failed", "call": "all_reduce", "where": "t.py:8 in <module>", "error": "timeout",
        ...            "fr": {"active": [{"pg": "0", "seq": 2, "op": "all_reduce"}], "enqueued": {"0": 2}}},
        ...        1: {"state": "running", "call": "barrier", "where": "t.py:9 in <module>",
        ...            "fr": {"active": [{"pg": "0", "seq": 2, "op": "barrier"}], "enqueued": {"0": 2}}}}
        >>> sts[1]["fr"]["recent"] = {"0": [{"seq": 2, "op": "barrier"}]}
        >>> print(format_hang_report("all_reduce failed on rank 0", 0, sts, {"pg": "0", "seq": 2, "op": "all_reduce"}))
        ... # doctest: +NORMALIZE_WHITESPACE
        all_reduce failed on rank 0.
        Where every rank is:
          rank 0: failed in all_reduce #2 (group 0) at t.py:8 in <module>: timeout
          rank 1: waiting in barrier #2 (group 0) at t.py:9 in <module>
        Did not arrive at all_reduce #2 (group 0): rank 1 (it called barrier as collective #2: the ranks
        called different collectives, so one of them skipped or added a collective).
    """
    lines = [headline.rstrip(".") + ".", "Where every rank is:"]
    by_text: dict[str, list[int]] = {}
    for rank in sorted(statuses):
        by_text.setdefault(describe_status(statuses[rank]), []).append(rank)
    for text, ranks in sorted(by_text.items(), key=lambda item: item[1][0]):
        lines.append(f"  {'rank' if len(ranks) == 1 else 'ranks'} {rank_ranges(ranks)}: {text}")
    if reference is not None:
        pg, seq, op = str(reference["pg"]), int(reference["seq"]), reference["op"]
        missing: dict[str, list[int]] = {}
        for rank in sorted(statuses):
            if rank == me:
                continue
            why = _not_arrived_reason(statuses[rank], pg, seq, op)
            if why is not None:
                missing.setdefault(why, []).append(rank)
        if missing:
            parts = [
                f"{'rank' if len(r) == 1 else 'ranks'} {rank_ranges(r)} ({why})" for why, r in missing.items()
            ]
            lines.append(f"Did not arrive at {op} #{seq} (group {pg}): " + "; ".join(parts) + ".")
        else:
            lines.append(
                f"Every rank reached {op} #{seq} (group {pg}): the collective itself failed (a peer died or the "
                "network dropped), not a missing rank."
            )
    return "\n".join(lines)


# --------------------------------------------------------------------------------------
# Runtime: flight recorder, status responder, sync points.
# --------------------------------------------------------------------------------------


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


class _State:
    """What the installed diagnostics of this process hold."""

    def __init__(self, store: Any, rank: int, world_size: int, group: Any) -> None:
        self.group = group  # the world group this state belongs to (a new group needs a new state)
        self.rank = rank
        self.world_size = world_size
        self.pid = os.getpid()
        self.host = socket.gethostname()
        self.store = store  # main-thread operations
        self.listen_store = store.clone()  # the responder thread's own connection
        self.listen_store.set_timeout(timedelta(days=7))  # block on the queue without periodic timeouts
        self.main_ident = threading.main_thread().ident
        self.failure: dict[str, Any] | None = None
        self.arrival: dict[str, Any] | None = None
        self.arrival_seq: dict[str, int] = {}
        self.arrival_keys: set[str] = set()  # this rank's keys still in the store, removed on uninstall
        self.thread: threading.Thread | None = None


_state: _State | None = None
_previous_excepthook: Any = None


def is_installed() -> bool:
    """Whether this process answers status requests."""
    return _state is not None


def _flight_record() -> dict[str, Any]:
    try:
        from torch._C import _distributed_c10d as c10d

        dump = getattr(c10d, "_dump_fr_trace_json", None)
        if dump is None:
            return {}
        return json.loads(dump(True, False))
    except Exception:  # the recorder is an optional aid; no record is not an error
        return {}


def _own_status(state: _State, frames: list[Frame] | None = None) -> dict[str, Any]:
    if state.failure is not None:
        status = dict(state.failure)
        status["fr"] = summarize_flight_record(_flight_record())
        return status
    if frames is None:
        frame = sys._current_frames().get(state.main_ident or -1)
        frames = _frames_from_frame(frame) if frame is not None else []
    call, where, via = summarize_frames(frames)
    return {
        "rank": state.rank,
        "host": state.host,
        "pid": state.pid,
        "state": "running",
        "call": call,
        "where": where,
        "via": via,
        "arrival": state.arrival,
        "fr": summarize_flight_record(_flight_record()),
    }


def _respond(state: _State) -> None:
    """The responder thread: answer each status request until told to stop."""
    queue = f"{_KEY}/q/{state.rank}"
    while True:
        try:
            message = state.listen_store.queue_pop(queue, True)
        except Exception:  # the store went away (job ending): nothing left to answer
            return
        if message == _STOP:
            return
        try:
            request = json.loads(message)
            state.listen_store.set(
                f"{_KEY}/status/{request['id']}/{state.rank}", json.dumps(_own_status(state))
            )
        except Exception as exc:  # a malformed request must not kill the responder
            logger.debug("diagnostics responder: %s", exc)


def _mark_exit() -> None:
    state = _state
    if state is None or os.getpid() != state.pid:
        return  # a forked child (data-loader worker) is not this rank

    # Last words: a rank that failed and exits before another rank asks still tells it
    # where it failed and what its collectives were.
    last_words = {"rank": state.rank, "host": state.host, "pid": state.pid, **(state.failure or {})}
    last_words.update(state="exited", fr=summarize_flight_record(_flight_record()))

    def mark() -> None:
        try:
            quick = state.store.clone()
            quick.set_timeout(timedelta(seconds=2))
            quick.set(f"{_KEY}/exited/{state.rank}", json.dumps(last_words))
            quick.queue_push(f"{_KEY}/q/{state.rank}", _STOP)
        except Exception:
            pass  # the store is gone: nobody is left to ask (and the responder's pop fails)

    # Connecting to a store whose host rank already exited blocks for the store's whole
    # connect timeout: mark from a daemon thread and give it two seconds at most, so a
    # finished rank can never hang at exit.
    marker = threading.Thread(target=mark, name="shardwise-exit-mark", daemon=True)
    marker.start()
    marker.join(timeout=2.0)
    # The responder must be gone before the interpreter finalizes: a daemon thread that
    # comes back from a blocking store call (e.g. because the store's host rank exited)
    # while Python shuts down is killed inside C++ code, which aborts the whole process
    # ("terminate called without an active exception", exit code -6) after a clean run.
    if state.thread is not None:
        state.thread.join(timeout=2.0)


def _excepthook(exc_type: Any, exc: BaseException, tb: Any) -> None:
    try:
        report = diagnose_exception(exc)
        if report:
            logger.error("%s", report, extra={"all_ranks": True})
    except Exception:  # a diagnosis must never hide the original error
        pass
    (_previous_excepthook or sys.__excepthook__)(exc_type, exc, tb)


def install(group: Any = None) -> bool:
    """Start answering status requests for the default process group (idempotent).

    Called by ``init_distributed``. Returns False when the group's store is not reachable
    (then diagnoses fall back to this rank's own view).
    """
    global _state, _previous_excepthook
    try:
        import torch.distributed as dist

        if not dist.is_initialized():
            return False
        if _state is not None:
            if _state.group is dist.group.WORLD:
                return True
            uninstall()  # the group it served was destroyed (outside shardwise) and a new one made
        store = dist.distributed_c10d._get_default_store()
        if not hasattr(store, "queue_pop"):
            return False
        state = _State(store, dist.get_rank(), dist.get_world_size(), dist.group.WORLD)
    except Exception as exc:  # private API moved, or no store: no responder
        logger.debug("hang diagnosis not available: %s", exc)
        return False
    thread = threading.Thread(target=_respond, args=(state,), name="shardwise-diagnostics", daemon=True)
    state.thread = thread
    _state = state
    thread.start()
    atexit.register(_mark_exit)
    if sys.excepthook is not _excepthook:
        _previous_excepthook = sys.excepthook
        sys.excepthook = _excepthook
    return True


def uninstall() -> None:
    """Stop the responder (before the process group is destroyed)."""
    global _state, _previous_excepthook
    state = _state
    if state is None:
        return
    _state = None
    atexit.unregister(_mark_exit)
    if sys.excepthook is _excepthook:
        sys.excepthook = _previous_excepthook or sys.__excepthook__
        _previous_excepthook = None
    try:
        # A later group may reuse the same store: leave no arrival marks behind for it.
        for key in state.arrival_keys:
            state.store.delete_key(key)
        state.store.queue_push(f"{_KEY}/q/{state.rank}", _STOP)
        if state.thread is not None:
            state.thread.join(timeout=2.0)
    except Exception:  # the store is already gone: nothing left to clean
        pass


def _request_statuses(state: _State, ranks: Iterable[int], grace: float) -> dict[int, dict[str, Any] | None]:
    """Ask ranks where they are; wait up to ``grace`` seconds for the answers."""
    ranks = [r for r in ranks if r != state.rank]
    answers: dict[int, dict[str, Any] | None] = dict.fromkeys(ranks)
    if not ranks:
        return answers
    request_id = state.store.add(f"{_KEY}/requests", 1)
    payload = json.dumps({"id": request_id, "from": state.rank})
    pending = set(ranks)
    for rank in ranks:
        exited_key = f"{_KEY}/exited/{rank}"
        if state.store.check([exited_key]):
            answers[rank] = _last_words(state.store.get(exited_key), rank)
            pending.discard(rank)
        else:
            state.store.queue_push(f"{_KEY}/q/{rank}", payload)
    deadline = time.monotonic() + grace
    while pending and time.monotonic() < deadline:
        for rank in sorted(pending):
            key = f"{_KEY}/status/{request_id}/{rank}"
            if state.store.check([key]):
                answers[rank] = json.loads(state.store.get(key))
                state.store.delete_key(key)
                pending.discard(rank)
        if pending:
            time.sleep(0.05)
    return answers


def _last_words(raw: bytes, rank: int) -> dict[str, Any]:
    """The status an exited rank left behind (see ``_mark_exit``)."""
    try:
        status = json.loads(raw)
        if isinstance(status, dict) and status.get("state") == "exited":
            return status
    except ValueError:
        pass
    return {"rank": rank, "state": "exited"}


def _is_collective_failure(exc: BaseException) -> bool:
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


def diagnose_exception(exc: BaseException, grace: float = _ANSWER_GRACE_S) -> str | None:
    """Explain a failed collective: where every rank is and who did not arrive.

    Returns None when ``exc`` did not come from ``torch.distributed`` or diagnostics are
    not installed. Other ranks are told this rank failed, so their own reports say so.

    Example:
        >>> diagnose_exception(ValueError("not a collective")) is None
        True
    """
    if _state is None or isinstance(exc, RanksDidNotArriveError) or not _is_collective_failure(exc):
        return None
    install()  # re-targets the current world group if the one it served was replaced (cheap otherwise)
    state = _state
    if state is None:
        return None
    frames = frames_from_traceback(exc.__traceback__)
    call, where, via = summarize_frames(frames)
    error = f"{type(exc).__name__}: {short_error(str(exc))}".rstrip(": ")
    state.failure = {
        "rank": state.rank,
        "host": state.host,
        "pid": state.pid,
        "state": "failed",
        "call": call,
        "where": where,
        "via": via,
        "error": error if len(error) <= 200 else error[:197] + "...",
    }
    mine = _own_status(state)
    statuses: dict[int, dict[str, Any] | None] = {state.rank: mine}
    try:
        # In a large job every rank times out at once; one of them asking everyone is enough.
        if state.world_size > _EVERY_RANK_DIAGNOSES and state.store.add(f"{_KEY}/diagnoser", 1) != 1:
            return f"{call or 'a collective'} failed on rank {state.rank}; another rank reports where every rank is."
        statuses.update(_request_statuses(state, range(state.world_size), grace))
    except Exception as store_error:  # the store is gone too: report what this rank knows
        logger.debug("could not reach the other ranks: %s", store_error)
    fr = mine.get("fr") or {}
    reference = None
    if call:
        candidates = [a for a in fr.get("active") or [] if a["op"] == call] or [
            {"pg": pg, **last} for pg, last in (fr.get("last") or {}).items() if last["op"] == call
        ]
        if candidates:
            reference = {"pg": candidates[-1]["pg"], "seq": candidates[-1]["seq"], "op": call}
    headline = f"{call or 'a collective'} failed on rank {state.rank}" + (f" at {where}" if where else "")
    return format_hang_report(headline, state.rank, statuses, reference)


def _group_ranks(group: Any) -> tuple[list[int], str]:
    import torch.distributed as dist

    if group is None:
        world = dist.get_world_size()
        return list(range(world)), "world"
    ranks = sorted(dist.get_process_group_ranks(group))
    return ranks, "g" + "-".join(str(r) for r in ranks)


def check_all_ranks_arrive(op_name: str, timeout: timedelta | float | None = None, group: Any = None) -> None:
    """Wait until every rank of ``group`` reaches this point, or fail saying who did not and why.

    Every rank of the group must call it with the same ``op_name``, the same number of
    times. It uses the job's TCP store, not a collective, so a rank that never comes
    cannot make it hang: after a second it asks the missing ranks where they are and
    raises at once if one can never arrive (see :func:`why_cannot_arrive`); otherwise it
    raises when ``timeout`` passes. A no-op without a process group or with one rank.

    Args:
        op_name: the operation every rank must enter, e.g. ``"save_checkpoint"``.
        timeout: seconds or a timedelta; default the collective timeout
            (``SHARDWISE_TIMEOUT_SECONDS`` / ``SHARDWISE_TIMEOUT`` / ``DEEPSPEED_TIMEOUT``).
        group: the process group (default: the world).

    Raises:
        RanksDidNotArriveError: naming the missing ranks and where each of them is.

    Example:
        >>> from shardwise.comm.diagnostics import check_all_ranks_arrive
        >>> # check_all_ranks_arrive("save_checkpoint")
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    install()  # no-op when installed for the current world group
    state = _state
    if state is None:
        dist.barrier(group)  # no store access: the best we can do is an ordinary barrier
        return
    if timeout is None:
        from shardwise.comm.env import timeout_from_env

        timeout = timeout_from_env(os.environ)
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    ranks, group_key = _group_ranks(group)
    counter_key = f"{group_key}/{op_name}"
    seq = state.arrival_seq.get(counter_key, 0) + 1
    state.arrival_seq[counter_key] = seq
    prefix = f"{_KEY}/arrive/{counter_key}"
    store = state.store
    mine = f"{prefix}/{seq}/{state.rank}"
    store.set(mine, "1")
    state.arrival_keys.add(mine)
    if seq > 2:  # every rank passed seq-2 once anyone reached seq, so its keys are unused
        old = f"{prefix}/{seq - 2}/{state.rank}"
        store.delete_key(old)
        state.arrival_keys.discard(old)
    state.arrival = {"op": op_name, "seq": seq}
    keys = {rank: f"{prefix}/{seq}/{rank}" for rank in ranks}
    start = time.monotonic()
    next_probe = start + 1.0
    delay = 0.01
    try:
        while not store.check(list(keys.values())):
            now = time.monotonic()
            if now - start >= seconds or now >= next_probe:
                missing = [rank for rank, key in keys.items() if not store.check([key])]
                if not missing:
                    break
                statuses = _request_statuses(
                    state, missing, min(_ANSWER_GRACE_S, max(seconds - (now - start), 1.0))
                )
                my_fr = summarize_flight_record(_flight_record())
                reasons = {
                    r: why_cannot_arrive(statuses.get(r), my_fr["enqueued"], state.arrival) for r in missing
                }
                stuck = {r: why for r, why in reasons.items() if why}
                timed_out = time.monotonic() - start >= seconds
                if stuck or timed_out:
                    waited = seconds if timed_out else None
                    raise _not_arrived_error(op_name, seq, state.rank, missing, statuses, stuck, waited)
                next_probe = time.monotonic() + 2.0
            time.sleep(delay)
            delay = min(delay * 2, 0.2)
    finally:
        state.arrival = None


def _not_arrived_error(
    op_name: str,
    seq: int,
    me: int,
    missing: list[int],
    statuses: Mapping[int, Mapping[str, Any] | None],
    stuck: Mapping[int, str],
    waited: float | None,
) -> RanksDidNotArriveError:
    """The error for ranks that did not reach a sync point (pure; see :func:`check_all_ranks_arrive`).

    Example:
        >>> err = _not_arrived_error("save_checkpoint", 1, 0, [1], {1: {"state": "exited"}},
        ...                          {1: "it had already exited"}, None)
        >>> print(err)
        save_checkpoint (#1) was called on rank 0 but rank 1 will never call it.
          rank 1: it had already exited.
        save_checkpoint is collective: every rank must call it, in the same order as the other collectives. A call under `if rank == 0:` is the usual cause; call it on every rank.
    """
    names = rank_ranges(missing)
    plural = "ranks" if len(missing) > 1 else "rank"
    if waited is not None:
        headline = f"{op_name} (#{seq}): {plural} {names} did not arrive within {waited:g}s"
    else:
        headline = f"{op_name} (#{seq}) was called on rank {me} but {plural} {names} will never call it"
    lines = [headline + "."]
    for rank in missing:
        status = statuses.get(rank)
        why = stuck.get(rank)
        if why:
            where = (status or {}).get("where")
            lines.append(f"  rank {rank}: {why}" + (f", at {where}" if where else "") + ".")
        else:
            lines.append(f"  rank {rank}: {describe_status(status)}.")
    lines.append(
        f"{op_name} is collective: every rank must call it, in the same order as the other collectives. "
        "A call under `if rank == 0:` is the usual cause; call it on every rank."
    )
    return RanksDidNotArriveError(op_name, missing, "\n".join(lines))
