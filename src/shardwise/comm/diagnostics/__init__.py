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

The parts, one concern each (this package re-exports their public names):

* :mod:`.frames`: reading stacks (tracebacks, live frames, faulthandler dumps);
* :mod:`.flight_recorder`: switching torch's recorder on, reading and summarising it;
* :mod:`.status`: what one rank's status says (where it is, whether it can still arrive);
* :mod:`.report`: the multi-line reports and :class:`RanksDidNotArriveError`;
* :mod:`.responder`: the per-process state, the responder thread, asking the other ranks;
* :mod:`.diagnose`: :func:`install` and :func:`diagnose_exception`;
* :mod:`.arrival`: :func:`check_all_ranks_arrive`.
"""

from __future__ import annotations

from shardwise.comm.diagnostics.arrival import check_all_ranks_arrive
from shardwise.comm.diagnostics.diagnose import diagnose_exception, install
from shardwise.comm.diagnostics.flight_recorder import (
    FLIGHT_RECORDER_ENTRIES,
    enable_flight_recorder,
    flight_recorder_available,
    summarize_flight_record,
)
from shardwise.comm.diagnostics.frames import (
    Frame,
    frames_from_traceback,
    parse_faulthandler_dump,
    short_error,
    summarize_frames,
)
from shardwise.comm.diagnostics.frames import is_collective_failure as _is_collective_failure  # noqa: F401
from shardwise.comm.diagnostics.report import RanksDidNotArriveError, format_hang_report
from shardwise.comm.diagnostics.report import not_arrived_error as _not_arrived_error  # noqa: F401
from shardwise.comm.diagnostics.responder import is_installed, uninstall
from shardwise.comm.diagnostics.responder import last_words as _last_words  # noqa: F401
from shardwise.comm.diagnostics.status import describe_status, rank_ranges, why_cannot_arrive

# The underscored names above are what these helpers were called when this package was one
# module; they stay reachable here for existing callers and tests.
__all__ = [
    "FLIGHT_RECORDER_ENTRIES",
    "Frame",
    "RanksDidNotArriveError",
    "check_all_ranks_arrive",
    "describe_status",
    "diagnose_exception",
    "enable_flight_recorder",
    "flight_recorder_available",
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
