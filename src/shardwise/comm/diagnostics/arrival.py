"""Sync points for collective entry points: :func:`check_all_ranks_arrive`.

``save_checkpoint`` calls it first, before any collective, so ``if rank == 0:
engine.save_checkpoint(...)`` fails within seconds with "rank 1 never called save_checkpoint: it
is waiting in all_reduce #412 at train.py:88" instead of hanging every rank until the timeout.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

from shardwise.comm.diagnostics import responder
from shardwise.comm.diagnostics.diagnose import install
from shardwise.comm.diagnostics.flight_recorder import read_flight_record, summarize_flight_record
from shardwise.comm.diagnostics.report import not_arrived_error
from shardwise.comm.diagnostics.status import why_cannot_arrive
from shardwise.comm.group_type import Group

__all__ = ["check_all_ranks_arrive"]


def _group_ranks(group: Group) -> tuple[list[int], str]:
    import torch.distributed as dist

    if group is None:
        world = dist.get_world_size()
        return list(range(world)), "world"
    ranks = sorted(dist.get_process_group_ranks(group))
    return ranks, "g" + "-".join(str(r) for r in ranks)


def check_all_ranks_arrive(op_name: str, timeout: timedelta | float | None = None, group: Group = None) -> None:
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
    state = responder.current()
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
    prefix = f"{responder.STORE_KEY}/arrive/{counter_key}"
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
                statuses = responder.request_statuses(
                    state, missing, min(responder.ANSWER_GRACE_S, max(seconds - (now - start), 1.0))
                )
                my_fr = summarize_flight_record(read_flight_record())
                reasons = {
                    r: why_cannot_arrive(statuses.get(r), my_fr["enqueued"], state.arrival) for r in missing
                }
                stuck = {r: why for r, why in reasons.items() if why}
                timed_out = time.monotonic() - start >= seconds
                if stuck or timed_out:
                    waited = seconds if timed_out else None
                    raise not_arrived_error(op_name, seq, state.rank, missing, statuses, stuck, waited)
                next_probe = time.monotonic() + 2.0
            time.sleep(delay)
            delay = min(delay * 2, 0.2)
    finally:
        state.arrival = None
