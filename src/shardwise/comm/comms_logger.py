"""Record every collective that goes through :mod:`shardwise.comm` (``comms_logger``, spec 11.4).

When the config has a ``comms_logger`` section with ``enabled: true``, each collective
in :mod:`shardwise.comm.collectives` is timed and recorded with its op name, message
size, latency, and algorithmic and bus bandwidth. ``shardwise.comm.log_summary()``
then shows one table row per op and message size. While the logger is disabled, a
collective pays a single attribute check.

Message size ``S`` is what one rank contributes, in bytes: the tensor for
``all_reduce`` and ``broadcast``, the shard for ``reduce_scatter_tensor`` (its output)
and ``all_gather_into_tensor`` (its input). Op names are DeepSpeed's, so ``prof_ops``
lists written for DeepSpeed select the same collectives.

Latency, from the call until the result is complete:

* synchronous calls: the call itself (plus a device synchronisation on CUDA, since an
  NCCL call returns once the kernel is queued);
* asynchronous calls on CPU tensors: until the backend completes the work, taken from
  the work's future callback, so an all-reduce overlapped with backward is not charged
  for the backward it overlapped;
* asynchronous calls on CUDA tensors: until ``wait()`` plus a device synchronisation, an
  upper bound when the caller overlaps other work before waiting.

Bandwidth (``n`` ranks, ``t`` seconds; both in Gbit/s, i.e. bytes x 8 / 1e9):

* all_reduce: ``algbw = 2S/t``, ``busbw = (S/t) * 2(n-1)/n``;
* all_gather, reduce_scatter: ``S`` becomes ``S * n``; ``algbw = S/t``,
  ``busbw = (S/t)(n-1)/n``;
* all_to_all: ``algbw = S/t``, ``busbw = (S/t)(n-1)/n``;
* broadcast, barrier, point-to-point and the rest: ``busbw = algbw = S/t``.

Example:
    >>> import shardwise.comm as comm
    >>> comm.configure_comms_logger({"enabled": True})  # initialize() does this from the config
    >>> # ... train ...
    >>> # comm.log_summary()
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from shardwise.comm.comms_logger_api import CommRecord, DeepSpeedCommsLoggerMethods
from shardwise.utils.logging import logger
from shardwise.utils.report import report_logger

__all__ = [
    "COMMS_LOGGER",
    "CommRecord",
    "CommsLogger",
    "bandwidth_gbps",
    "configure",
    "configure_comms_logger",
    "format_summary",
    "get_comm_operation_count",
    "get_logged_comm_ops",
    "has_comm_data",
    "humanize_bytes",
    "log_summary",
    "reset_log",
    "trimmed_mean",
]

# Columns of the summary table (DeepSpeed's headers, 20 characters wide).
_COLUMNS = (
    "Comm. Op",
    "Message Size",
    "Count",
    "Total Latency(ms)",
    "Avg Latency(ms)",
    "tput_avg (Gbps)",
    "busbw_avg (Gbps)",
)
_WIDTH = 20


def humanize_bytes(nbytes: float) -> str:
    """``1536`` -> ``"1.5 KB"``: base 1024, up to two decimals, DeepSpeed's spelling.

    Example:
        >>> humanize_bytes(2), humanize_bytes(1536), humanize_bytes(3 * 2**20)
        ('2.0 B', '1.5 KB', '3.0 MB')
    """
    units = ("B", "KB", "MB", "GB", "TB", "PB")
    value = float(nbytes)
    unit = 0
    while value >= 1024 and unit < len(units) - 1:
        value /= 1024
        unit += 1
    return f"{round(value, 2)} {units[unit]}"


def bandwidth_gbps(op: str, nbytes: int, latency_ms: float, world_size: int) -> tuple[float, float]:
    """``(algbw, busbw)`` in Gbit/s for one collective (formulas in the module docstring).

    Args:
        op: the op name (``"all_reduce"``, ``"all_gather_into_tensor"``...); matched by substring.
        nbytes: bytes this rank contributed.
        latency_ms: how long it took.
        world_size: ranks in the group.

    Example:
        >>> bandwidth_gbps("all_reduce", 1_000_000, 1.0, 2)
        (16.0, 8.0)
        >>> bandwidth_gbps("reduce_scatter_tensor", 500_000, 1.0, 2)
        (8.0, 4.0)
    """
    if latency_ms <= 0:
        return 0.0, 0.0
    seconds = latency_ms / 1000.0
    n = max(world_size, 1)
    size = float(nbytes)
    if "all_reduce" in op:
        algbw = 2 * size / seconds
        busbw = (size / seconds) * (2 * (n - 1) / n)
    elif "all_gather" in op or "reduce_scatter" in op:
        size *= n
        algbw = size / seconds
        busbw = (size / seconds) * ((n - 1) / n)
    elif "all_to_all" in op:
        algbw = size / seconds
        busbw = (size / seconds) * ((n - 1) / n)
    else:
        algbw = busbw = size / seconds
    to_gbps = 8 / 1e9
    return algbw * to_gbps, busbw * to_gbps


def trimmed_mean(values: Sequence[float], trim: float = 0.1) -> float:
    """Mean after dropping the lowest and highest ``round(n * trim)`` values (robust to warm-up outliers;
    DeepSpeed's ``trim_mean``, rounding included, so the summary's averages are DeepSpeed's).

    Example:
        >>> trimmed_mean([1.0] * 9 + [100.0])
        1.0
    """
    if not values:
        return 0.0
    ordered = sorted(values)
    cut = round(len(ordered) * trim)
    kept = ordered[cut : len(ordered) - cut] or ordered
    return sum(kept) / len(kept)


@dataclass
class PendingComm:
    """A collective in flight: started, not yet known to be complete."""

    owner: CommsLogger
    op: str
    nbytes: int
    world_size: int
    start: float
    on_cuda: bool
    end: float | None = None

    def watch(self, work: object) -> None:
        """Take the completion time from ``work``'s future (CPU backends run the callback on completion)."""
        if self.on_cuda or work is None or not hasattr(work, "get_future"):
            return
        try:
            future = work.get_future()
        except RuntimeError:  # backends without futures: the wait time is used instead
            return

        def completed(_: object) -> None:
            if self.end is None:
                self.end = time.perf_counter()

        future.then(completed)

    def complete(self) -> None:
        """The result is complete: record it."""
        if self.on_cuda:
            import torch

            torch.cuda.synchronize()
        end = self.end if self.end is not None else time.perf_counter()
        self.owner.record(self.op, self.nbytes, (end - self.start) * 1000.0, self.world_size)


@dataclass
class CommsLogger(DeepSpeedCommsLoggerMethods):
    """The process-wide record of collectives; use the module's :data:`COMMS_LOGGER`."""

    enabled: bool = False
    verbose: bool = False
    prof_all: bool = True
    debug: bool = False
    prof_ops: list[str] = field(default_factory=list)
    records: dict[str, dict[int, list[CommRecord]]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def configure(self, section: Any) -> None:
        """Apply a ``comms_logger`` section (a config object, a dict, or None to switch off).

        Raises:
            ValueError: a dict with keys the section does not have.
        """
        if section is None:
            self.enabled = False
            return
        if isinstance(section, Mapping):
            from shardwise.config.sections.observability import CommsLoggerConfig

            section = CommsLoggerConfig.model_validate(dict(section))
        self.enabled = bool(section.enabled)
        self.verbose = bool(section.verbose)
        self.prof_all = bool(section.prof_all)
        self.debug = bool(section.debug)
        self.prof_ops = list(section.prof_ops)

    def start(self, op: str, nbytes: int, world_size: int, on_cuda: bool, force: bool = False) -> PendingComm | None:
        """Begin timing ``op`` if it is profiled (``prof_all``, listed in ``prof_ops``, or ``force``:
        a ``deepspeed.comm`` call's ``prof=True``)."""
        if not (force or self.prof_all or op in self.prof_ops):
            return None
        if self.debug:
            op = f"{op} | [Caller Func: {_caller()}]"
        if on_cuda:
            import torch

            torch.cuda.synchronize()  # do not charge earlier queued kernels to this collective
        return PendingComm(self, op, nbytes, world_size, time.perf_counter(), on_cuda)

    def record(self, op: str, nbytes: int, latency_ms: float, world_size: int) -> None:
        """Add one finished collective."""
        algbw, busbw = bandwidth_gbps(op, nbytes, latency_ms, world_size)
        entry = CommRecord(op, nbytes, latency_ms, algbw, busbw, world_size)
        with self._lock:
            self.records.setdefault(op, {}).setdefault(nbytes, []).append(entry)
        if self.verbose:
            logger.info(
                "comm op: %s | time (ms): %.2f | msg size: %s | algbw (Gbps): %.2f | busbw (Gbps): %.2f",
                op,
                latency_ms,
                humanize_bytes(nbytes),
                algbw,
                busbw,
            )

    def reset(self) -> None:
        """Forget every record (the configuration stays)."""
        with self._lock:
            self.records = {}

    def summary(self) -> dict[str, dict[int, dict[str, Any]]]:
        """``{op: {msg_size_bytes: {count, total_latency_ms, avg_latency_ms, ...}}}``."""
        with self._lock:
            snapshot = {
                op: {size: list(rs) for size, rs in sizes.items()} for op, sizes in self.records.items()
            }
        out: dict[str, dict[int, dict[str, Any]]] = {}
        for op, sizes in snapshot.items():
            rows: dict[int, dict[str, Any]] = {}
            for size in sorted(sizes):
                recs = sizes[size]
                latencies = [r.latency_ms for r in recs]
                rows[size] = {
                    "count": len(recs),
                    "total_latency_ms": sum(latencies),
                    "avg_latency_ms": trimmed_mean(latencies),
                    "tput_avg_gbps": trimmed_mean([r.algbw_gbps for r in recs]),
                    "busbw_avg_gbps": trimmed_mean([r.busbw_gbps for r in recs]),
                    "msg_size_bytes": size,
                    "msg_size_str": humanize_bytes(size),
                }
            out[op] = rows
        return out


def _caller() -> str:
    """The first function outside :mod:`shardwise.comm` on the stack (for ``debug``)."""
    import sys

    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__", "").startswith("shardwise.comm"):
        frame = frame.f_back  # type: ignore[assignment]
    return frame.f_code.co_name if frame is not None else "?"


COMMS_LOGGER = CommsLogger()


def format_summary(
    summary: Mapping[str, Mapping[int, Mapping[str, Any]]],
    straggler: Mapping[str, Mapping[int, float]] | None = None,
) -> str:
    """The summary as DeepSpeed's table: a header, then per op its name and one row per size.

    Example:
        >>> table = format_summary({"all_reduce": {4: {"count": 2, "total_latency_ms": 1.0,
        ...     "avg_latency_ms": 0.5, "tput_avg_gbps": 0.0, "busbw_avg_gbps": 0.0, "msg_size_str": "4.0 B"}}})
        >>> table.splitlines()[1]
        'all_reduce'
    """
    columns = list(_COLUMNS) + (["Straggler Effect(ms)"] if straggler is not None else [])
    lines = ["".join(c.ljust(_WIDTH) for c in columns).rstrip()]
    for op, sizes in summary.items():
        lines.append(op)
        for size, row in sizes.items():
            cells = [
                "",
                row["msg_size_str"],
                str(row["count"]),
                f"{row['total_latency_ms']:.2f}",
                f"{row['avg_latency_ms']:.2f}",
                f"{row['tput_avg_gbps']:.2f}",
                f"{row['busbw_avg_gbps']:.2f}",
            ]
            if straggler is not None:
                cells.append(f"{straggler.get(op, {}).get(size, 0.0):.2f}")
            lines.append("".join(c.ljust(_WIDTH) for c in cells).rstrip())
    return "\n".join(lines)


def _straggler_effect(
    summary: Mapping[str, Mapping[int, Mapping[str, Any]]],
) -> dict[str, dict[int, float]]:
    """Per op and size: this rank's total latency minus the smallest over all ranks.

    A collective finishes together everywhere, so the extra time a rank spent in it beyond
    the fastest rank is time spent waiting for a late partner. Every rank must call this
    (one all-gather of the keys, one all-reduce of the totals).
    """
    import torch
    import torch.distributed as dist

    keys = [(op, size) for op, sizes in summary.items() for size in sizes]
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return {op: {size: 0.0 for size in sizes} for op, sizes in summary.items()}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, keys)
    common = sorted(set.intersection(*(set(k) for k in gathered)))
    totals = torch.tensor(
        [float(summary[op][size]["total_latency_ms"]) for op, size in common], dtype=torch.float64
    )
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    fastest = totals.to(device)
    dist.all_reduce(fastest, op=dist.ReduceOp.MIN)
    out: dict[str, dict[int, float]] = {}
    for (op, size), mine, low in zip(common, totals.tolist(), fastest.cpu().tolist()):
        out.setdefault(op, {})[size] = mine - low
    return out


def log_summary(show_straggler: bool = False, return_dict: bool = False) -> dict[str, Any] | None:
    """Log the table of recorded collectives on rank 0 (``deepspeed.comm.log_summary``).

    Args:
        show_straggler: add a column with each op's straggler effect; every rank must call.
        return_dict: also return ``{"summary", "straggler_analysis", "metadata"}``.

    Example:
        >>> import shardwise.comm as comm
        >>> # comm.log_summary()
        >>> # -> Comm. Op            Message Size        Count  ...
    """
    summary = COMMS_LOGGER.summary()
    straggler = _straggler_effect(summary) if show_straggler else None
    rank, world = _rank_and_world()
    if rank == 0:
        report_logger().info("communication summary (rank 0):\n%s", format_summary(summary, straggler))
    if not return_dict:
        return None
    return {
        "summary": summary,
        "straggler_analysis": straggler,
        "metadata": {
            "world_size": world,
            "rank": rank,
            "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        },
    }


def _rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def configure_comms_logger(section: object) -> None:
    """Switch the process-wide comms logger on or off from a ``comms_logger`` section or dict."""
    COMMS_LOGGER.configure(section)


def configure(
    config: object = None,
    *,
    enabled: bool | None = None,
    prof_all: bool | None = None,
    prof_ops: list[str] | None = None,
    verbose: bool | None = None,
    debug: bool | None = None,
) -> None:
    """``deepspeed.comm.configure``: apply a config's ``comms_logger`` section, then any keyword.

    Args:
        config: a resolved config, a config dict, or a ``comms_logger`` section; None keeps
            the current settings.
        enabled, prof_all, prof_ops, verbose, debug: override one setting each.

    Example:
        >>> configure(enabled=True, prof_all=False, prof_ops=["all_reduce"])
        >>> COMMS_LOGGER.prof_ops
        ['all_reduce']
        >>> configure(enabled=False)
    """
    if config is not None:
        section = (
            config.get("comms_logger") if isinstance(config, Mapping) and "enabled" not in config else config
        )
        from shardwise.config.resolve import ResolvedConfig

        if isinstance(section, ResolvedConfig):
            section = section.config
        section = getattr(section, "comms_logger", section)
        COMMS_LOGGER.configure(section)
    if prof_ops is not None:
        COMMS_LOGGER.prof_ops = list(prof_ops)
    for name, flag in (("enabled", enabled), ("prof_all", prof_all), ("verbose", verbose), ("debug", debug)):
        if flag is not None:
            setattr(COMMS_LOGGER, name, bool(flag))


def reset_log() -> None:
    """Forget every recorded collective."""
    COMMS_LOGGER.reset()


def has_comm_data() -> bool:
    """Whether any collective has been recorded."""
    return bool(COMMS_LOGGER.records)


def get_comm_operation_count() -> int:
    """How many collectives have been recorded."""
    return sum(len(rs) for sizes in COMMS_LOGGER.records.values() for rs in sizes.values())


def get_logged_comm_ops() -> list[str]:
    """The op names recorded so far."""
    return list(COMMS_LOGGER.records)
