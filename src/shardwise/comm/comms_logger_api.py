"""DeepSpeed's ``CommsLogger`` methods (``deepspeed.utils.comms_logging.CommsLogger`` is
:class:`shardwise.comm.comms_logger.CommsLogger`, which takes them from :class:`DeepSpeedCommsLoggerMethods`):
switching profiling on and off, adding a record by hand, and reading the records in DeepSpeed's layout
``{op: {msg_size: [count, [latencies], [algbws], [busbws]]}}`` (``comms_dict``, ``get_raw_data``).

Example:
    >>> from shardwise.comm.comms_logger import CommsLogger
    >>> log = CommsLogger()
    >>> log.comms_dict = {"all_reduce": {8: [1, [2.0], [0.1], [0.05]]}}
    >>> log.get_total_operations(), log.get_operation_names()
    (1, ['all_reduce'])
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["CommRecord", "DeepSpeedCommsLoggerMethods"]


@dataclass
class CommRecord:
    """One collective as recorded."""

    op: str
    nbytes: int
    latency_ms: float
    algbw_gbps: float
    busbw_gbps: float
    world_size: int


class DeepSpeedCommsLoggerMethods:
    """The DeepSpeed-named methods, over the logger's ``records`` (``{op: {nbytes: [CommRecord]}}``)."""

    records: dict[str, dict[int, list[Any]]]
    prof_all: bool
    prof_ops: list[str]
    record: Callable[[str, int, float, int], None]  # the logger's own methods, which these build on
    summary: Callable[[], dict[str, dict[int, dict[str, Any]]]]

    def start_profiling_comms(self) -> None:
        """Profile every op (``prof_all``)."""
        self.prof_all = True

    def stop_profiling_comms(self) -> None:
        """Profile only the ops in ``prof_ops`` (and calls passing ``prof=True``)."""
        self.prof_all = False

    def start_profiling_op(self, op_name_list: Iterable[str]) -> None:
        """Add ops to ``prof_ops``."""
        self.prof_ops = self.prof_ops + [op for op in op_name_list if op not in self.prof_ops]

    def stop_profiling_op(self, op_name_list: Iterable[str]) -> None:
        """Remove ops from ``prof_ops``."""
        dropped = set(op_name_list)
        self.prof_ops = [op for op in self.prof_ops if op not in dropped]

    def append(self, raw_name: str, record_name: str, latency: float, msg_size: int) -> None:
        """Record one op of ``msg_size`` bytes that took ``latency`` ms under ``record_name`` (the world's size
        for its bandwidth; ``raw_name`` is DeepSpeed's op name, which ``record_name`` starts with)."""
        import torch.distributed as dist

        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.record(record_name, msg_size, latency, world)

    @property
    def comms_dict(self) -> dict[str, dict[int, list[Any]]]:
        """The records in DeepSpeed's layout (a fresh copy); assigning one replaces the records."""
        return {
            op: {size: [len(rs), [r.latency_ms for r in rs], [r.algbw_gbps for r in rs], [r.busbw_gbps for r in rs]]
                 for size, rs in sizes.items()}
            for op, sizes in self.records.items()
        }

    @comms_dict.setter
    def comms_dict(self, value: dict[str, dict[int, list[Any]]]) -> None:
        self.records = {
            op: {size: [CommRecord(op, size, lat, alg, bus, 1) for lat, alg, bus in zip(row[1], row[2], row[3])]
                 for size, row in sizes.items()}
            for op, sizes in value.items()
        }

    def get_raw_data(self) -> dict[str, dict[int, list[Any]]]:
        """:attr:`comms_dict`."""
        return self.comms_dict

    def has_data(self) -> bool:
        """Whether anything is recorded."""
        return bool(self.records)

    def reset_data(self) -> None:
        """Forget every record."""
        self.records = {}

    def get_operation_names(self) -> list[str]:
        """The recorded op names, in the order first seen."""
        return list(self.records)

    def get_total_operations(self) -> int:
        """How many ops are recorded."""
        return sum(len(rs) for sizes in self.records.values() for rs in sizes.values())

    def get_operation_summary(self, operation_name: str) -> dict[int, dict[str, Any]] | None:
        """``{msg_size: {count, total_latency_ms, avg_latency_ms, tput_avg_gbps, ...}}`` for one op (None: not recorded)."""
        return self.summary().get(operation_name)
