"""The status responder: every rank answers "where are you?" from a daemon thread.

The thread blocks on a queue in the job's TCP store (one extra store connection, no polling).
Asked, it answers with this rank's flight-recorder state and the Python stack of its main
thread, which works while the main thread is blocked in a collective or busy elsewhere. This
module also asks the other ranks (:func:`request_statuses`), leaves "last words" in the store
when the process exits, and logs a diagnosis of an exception nobody caught.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

from shardwise.comm.diagnostics.flight_recorder import read_flight_record, summarize_flight_record
from shardwise.comm.diagnostics.frames import Frame, frames_from_frame, summarize_frames
from shardwise.comm.group_type import Group
from shardwise.utils.logging import logger

__all__ = [
    "ANSWER_GRACE_S",
    "STORE_KEY",
    "ResponderState",
    "current",
    "install",
    "is_installed",
    "last_words",
    "own_status",
    "request_statuses",
    "uninstall",
]


STORE_KEY = "shardwise/diag"

_STOP = b"__stop__"

# Grace for other ranks' answers: they answer from a thread within milliseconds when alive.
ANSWER_GRACE_S = 5.0


class ResponderState:
    """What the installed diagnostics of this process hold."""

    def __init__(self, store: Any, rank: int, world_size: int, group: Group) -> None:
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


_state: ResponderState | None = None

_previous_excepthook: Any = None
_diagnose: Callable[[BaseException], str | None] | None = None  # what the excepthook logs


def current() -> ResponderState | None:
    """This process's diagnostics state; None when not installed."""
    return _state


def is_installed() -> bool:
    """Whether this process answers status requests."""
    return _state is not None


def own_status(state: ResponderState, frames: list[Frame] | None = None) -> dict[str, Any]:
    """This rank's status: its failure if it failed, else where its main thread is now."""
    if state.failure is not None:
        status = dict(state.failure)
        status["fr"] = summarize_flight_record(read_flight_record())
        return status
    if frames is None:
        frame = sys._current_frames().get(state.main_ident or -1)
        frames = frames_from_frame(frame) if frame is not None else []
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
        "fr": summarize_flight_record(read_flight_record()),
    }


def _respond(state: ResponderState) -> None:
    """The responder thread: answer each status request until told to stop."""
    queue = f"{STORE_KEY}/q/{state.rank}"
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
                f"{STORE_KEY}/status/{request['id']}/{state.rank}", json.dumps(own_status(state))
            )
        except Exception as exc:  # a malformed request must not kill the responder
            logger.debug("diagnostics responder: %s", exc)


def _mark_exit() -> None:
    state = _state
    if state is None or os.getpid() != state.pid:
        return  # a forked child (data-loader worker) is not this rank

    # Last words: a rank that failed and exits before another rank asks still tells it
    # where it failed and what its collectives were.
    final_status = {"rank": state.rank, "host": state.host, "pid": state.pid, **(state.failure or {})}
    final_status.update(state="exited", fr=summarize_flight_record(read_flight_record()))

    def mark() -> None:
        try:
            quick = state.store.clone()
            quick.set_timeout(timedelta(seconds=2))
            quick.set(f"{STORE_KEY}/exited/{state.rank}", json.dumps(final_status))
            quick.queue_push(f"{STORE_KEY}/q/{state.rank}", _STOP)
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
        report = _diagnose(exc) if _diagnose is not None else None
        if report:
            logger.error("%s", report, extra={"all_ranks": True})
    except Exception:  # a diagnosis must never hide the original error
        pass
    (_previous_excepthook or sys.__excepthook__)(exc_type, exc, tb)


def _has_queues(store: object) -> bool:
    """Whether ``store`` serves queues: a TCP store does; a FileStore (``init_method="file://..."``) has
    the methods but raises "queue support is not implemented" when one is called."""
    try:
        store.queue_len(f"{STORE_KEY}/probe")  # type: ignore[attr-defined]
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return True


def install(diagnose: Callable[[BaseException], str | None], group: Group = None) -> bool:
    """Start answering status requests for the default process group (idempotent), and log
    ``diagnose(exc)`` for an exception nobody caught.

    Returns False when the group's store is not reachable (then diagnoses fall back to this
    rank's own view).
    """
    global _state, _previous_excepthook, _diagnose
    _diagnose = diagnose
    try:
        import torch.distributed as dist

        if not dist.is_initialized():
            return False
        if _state is not None:
            if _state.group is dist.group.WORLD:
                return True
            uninstall()  # the group it served was destroyed (outside shardwise) and a new one made
        store = dist.distributed_c10d._get_default_store()
        if not _has_queues(store):
            return False
        state = ResponderState(store, dist.get_rank(), dist.get_world_size(), dist.group.WORLD)
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
        state.store.queue_push(f"{STORE_KEY}/q/{state.rank}", _STOP)
        if state.thread is not None:
            state.thread.join(timeout=2.0)
    except Exception:  # the store is already gone: nothing left to clean
        pass


def request_statuses(
    state: ResponderState, ranks: Iterable[int], grace: float
) -> dict[int, dict[str, Any] | None]:
    """Ask ranks where they are; wait up to ``grace`` seconds for the answers."""
    ranks = [r for r in ranks if r != state.rank]
    answers: dict[int, dict[str, Any] | None] = dict.fromkeys(ranks)
    if not ranks:
        return answers
    request_id = state.store.add(f"{STORE_KEY}/requests", 1)
    payload = json.dumps({"id": request_id, "from": state.rank})
    pending = set(ranks)
    for rank in ranks:
        exited_key = f"{STORE_KEY}/exited/{rank}"
        if state.store.check([exited_key]):
            answers[rank] = last_words(state.store.get(exited_key), rank)
            pending.discard(rank)
        else:
            state.store.queue_push(f"{STORE_KEY}/q/{rank}", payload)
    deadline = time.monotonic() + grace
    while pending and time.monotonic() < deadline:
        for rank in sorted(pending):
            key = f"{STORE_KEY}/status/{request_id}/{rank}"
            if state.store.check([key]):
                answers[rank] = json.loads(state.store.get(key))
                state.store.delete_key(key)
                pending.discard(rank)
        if pending:
            time.sleep(0.05)
    return answers


def last_words(raw: bytes, rank: int) -> dict[str, Any]:
    """The status an exited rank left behind (see ``_mark_exit``)."""
    try:
        status = json.loads(raw)
        if isinstance(status, dict) and status.get("state") == "exited":
            return status
    except ValueError:
        pass
    return {"rank": rank, "state": "exited"}
