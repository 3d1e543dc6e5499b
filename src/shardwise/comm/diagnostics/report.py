"""The reports: a failed collective (where every rank is, who did not arrive) and a sync
point some ranks will never reach (:class:`RanksDidNotArriveError`). Pure text from statuses.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardwise.comm.diagnostics.status import describe_status, rank_ranges

__all__ = ["RanksDidNotArriveError", "format_hang_report", "not_arrived_error"]


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


def not_arrived_error(
    op_name: str,
    seq: int,
    me: int,
    missing: list[int],
    statuses: Mapping[int, Mapping[str, object] | None],
    stuck: Mapping[int, str],
    waited: float | None,
) -> RanksDidNotArriveError:
    """The error for ranks that did not reach a sync point (pure; see :func:`check_all_ranks_arrive`).

    Example:
        >>> err = not_arrived_error("save_checkpoint", 1, 0, [1], {1: {"state": "exited"}},
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
