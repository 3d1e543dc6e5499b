"""A rank-aware logger: quiet by default, rank 0 only unless asked.

The library never prints; it logs through ``get_logger()``. Records from ranks other
than 0 are dropped unless ``SHARDWISE_LOG_ALL_RANKS=1`` is set, so a 2-rank run shows
each line once. The level comes from the config's ``log_level`` or
``SHARDWISE_LOG_LEVEL`` (default ``WARNING``, like DeepSpeed 0.19.8).
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Sequence

_LOGGER_NAME = "shardwise"


def _current_rank() -> int:
    """The global rank from the launcher's environment (no torch import needed)."""
    for var in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        value = os.environ.get(var)
        if value is not None and value.strip().lstrip("-").isdigit():
            return int(value)
    return 0


class _RankFilter(logging.Filter):
    """Drops records on ranks other than 0 unless all ranks were asked for."""

    def filter(self, record: logging.LogRecord) -> bool:
        rank = _current_rank()
        record.rank = rank
        if os.environ.get("SHARDWISE_LOG_ALL_RANKS") == "1":
            return True
        return rank == 0 or getattr(record, "all_ranks", False)


def get_logger() -> logging.Logger:
    """Return the library logger, configured once.

    Example:
        >>> from shardwise.utils.logging import get_logger
        >>> get_logger().info("hello")  # shown at INFO level, rank 0 only
    """
    logger = logging.getLogger(_LOGGER_NAME)
    if not getattr(logger, "_shardwise_configured", False):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[shardwise] [%(levelname)s] [rank%(rank)s] %(message)s"))
        handler.addFilter(_RankFilter())
        logger.addHandler(handler)
        logger.propagate = False
        logger.setLevel(os.environ.get("SHARDWISE_LOG_LEVEL", "WARNING").upper())
        logger._shardwise_configured = True  # type: ignore[attr-defined]
    return logger


def set_log_level(level: str | int) -> None:
    """Set the library log level from a name (``"info"``) or a ``logging`` constant."""
    get_logger().setLevel(level.upper() if isinstance(level, str) else level)


_LEVEL_NAMES = ("debug", "info", "warning", "error", "critical")


def set_log_level_from_string(log_level_str: str, custom_logger: logging.Logger | None = None) -> None:
    """Set a logger's level and its handlers' from a name (``"info"``); default: the library logger.

    Raises:
        ValueError: a name that is not one of debug, info, warning, error, critical.
    """
    name = log_level_str.lower() if isinstance(log_level_str, str) else log_level_str
    if name not in _LEVEL_NAMES:
        raise ValueError(f"log level {log_level_str!r}: must be one of {', '.join(_LEVEL_NAMES)}")
    target = get_logger() if custom_logger is None else custom_logger
    level = getattr(logging, name.upper())
    target.setLevel(level)
    for handler in target.handlers:
        handler.setLevel(level)


logger = get_logger()

_RANK_VARIABLES = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")


def dist_message(message: str, ranks: Sequence[int] | None = None) -> str | None:
    """DeepSpeed's rank rule for ``log_dist``: ``"[Rank r] message"`` when this rank should log it, else None.

    Outside a launched job (no launcher rank variable) every call logs, as rank -1. In a launched job a
    message logs on the ranks listed in ``ranks`` (``[-1]``: every rank) and nowhere when ``ranks`` is empty.
    The rank is the launcher's (the library logger's rank, read without torch).

    Example:
        >>> import os; os.environ["RANK"] = "1"
        >>> dist_message("hi", ranks=[0]), dist_message("hi", ranks=[1]), dist_message("hi", ranks=[-1])
        (None, '[Rank 1] hi', '[Rank 1] hi')
        >>> del os.environ["RANK"]; dist_message("hi")
        '[Rank -1] hi'
    """
    if not any(os.environ.get(name) is not None for name in _RANK_VARIABLES):
        return f"[Rank -1] {message}"
    rank = _current_rank()
    ranks = list(ranks or [])
    if ranks and (ranks[0] == -1 or rank in ranks):
        return f"[Rank {rank}] {message}"
    return None


def log_dist(message: str, ranks: Sequence[int] | None = None, level: int = logging.INFO) -> None:
    """Log ``message`` on the ranks :func:`dist_message` picks, prefixed with the rank (DeepSpeed's ``log_dist``)."""
    text = dist_message(message, ranks)
    if text is not None:
        get_logger().log(level, text, extra={"all_ranks": True})


@functools.lru_cache(None)
def _log_dist_once(message: str, ranks: tuple[int, ...] | None, level: int) -> None:
    log_dist(message, None if ranks is None else list(ranks), level)


def log_dist_once(message: str, ranks: Sequence[int] | None = None, level: int = logging.INFO) -> None:
    """:func:`log_dist`, each distinct (message, ranks, level) once per process."""
    _log_dist_once(message, None if ranks is None else tuple(ranks), level)
