"""Where requested telemetry goes: a logger that shows it at the default level.

The library logger is quiet by default (``WARNING``, like DeepSpeed 0.19.8), which in
DeepSpeed hides the very lines a user asked for with ``steps_per_print``,
``wall_clock_breakdown`` or ``memory_breakdown``. Output the user switched on in the
config goes through the child logger ``shardwise.report`` instead, which logs at INFO
(or DEBUG, if the library is at DEBUG) while the library level is ``WARNING`` or
chattier, and follows the library level when it is ``ERROR`` or ``CRITICAL``
(``log_level: "error"`` silences it). Its records
go through the library's handler, so they keep the rank-0-only filter and the
``[shardwise] [INFO] [rank0]`` prefix.
"""

from __future__ import annotations

import logging

from shardwise.utils.logging import get_logger

_REPORT_LOGGER = "shardwise.report"


def report_logger() -> logging.Logger:
    """The logger for output the config asked for (progress lines, timers, profiles).

    Example:
        >>> report_logger().info("step=10, loss=2.31")  # shown on rank 0 at the default level
    """
    base = get_logger()
    log = logging.getLogger(_REPORT_LOGGER)
    level = base.getEffectiveLevel()
    log.setLevel(min(level, logging.INFO) if level <= logging.WARNING else level)
    return log
