"""A failed collective, explained: ask every rank where it is and say who did not arrive.

``init_distributed`` calls :func:`install`, so an uncaught collective failure is logged with the
report; the shardwise launcher's worker puts :func:`diagnose_exception`'s text into its failure
summary.
"""

from __future__ import annotations

from shardwise.comm.diagnostics import responder
from shardwise.comm.diagnostics.frames import (
    frames_from_traceback,
    is_collective_failure,
    short_error,
    summarize_frames,
)
from shardwise.comm.diagnostics.report import RanksDidNotArriveError, format_hang_report
from shardwise.comm.group_type import Group
from shardwise.utils.logging import logger

__all__ = ["diagnose_exception", "install"]


_EVERY_RANK_DIAGNOSES = 16  # up to this world size every failing rank asks every rank


def install(group: Group = None) -> bool:
    """Start answering status requests for the default process group (idempotent).

    Called by ``init_distributed``. Returns False when the group's store is not reachable
    (then diagnoses fall back to this rank's own view). An exception nobody catches is
    logged with :func:`diagnose_exception`'s report.
    """
    return responder.install(diagnose_exception, group)


def diagnose_exception(exc: BaseException, grace: float = responder.ANSWER_GRACE_S) -> str | None:
    """Explain a failed collective: where every rank is and who did not arrive.

    Returns None when ``exc`` did not come from ``torch.distributed`` or diagnostics are
    not installed. Other ranks are told this rank failed, so their own reports say so.

    Example:
        >>> diagnose_exception(ValueError("not a collective")) is None
        True
    """
    if (
        responder.current() is None
        or isinstance(exc, RanksDidNotArriveError)
        or not is_collective_failure(exc)
    ):
        return None
    install()  # re-targets the current world group if the one it served was replaced (cheap otherwise)
    state = responder.current()
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
    mine = responder.own_status(state)
    statuses: dict[int, dict[str, object] | None] = {state.rank: mine}
    try:
        # In a large job every rank times out at once; one of them asking everyone is enough.
        if (
            state.world_size > _EVERY_RANK_DIAGNOSES
            and state.store.add(f"{responder.STORE_KEY}/diagnoser", 1) != 1
        ):
            return f"{call or 'a collective'} failed on rank {state.rank}; another rank reports where every rank is."
        statuses.update(responder.request_statuses(state, range(state.world_size), grace))
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
