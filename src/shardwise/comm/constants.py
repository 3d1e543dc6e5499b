"""``deepspeed.comm.constants``: the communication backends' names and the ``comms_logger`` section's keys
and defaults (the same defaults :class:`shardwise.config.sections.observability.CommsLoggerConfig` has).

shardwise runs on the backends torch has (``nccl``, ``gloo``; ``mpi`` where torch was built with it);
``ccl``, ``hccl`` and ``sccl`` name DeepSpeed's own backends for other accelerators, which shardwise
does not have (torch rejects them as unknown backends).

Example:
    >>> NCCL_BACKEND, GLOO_BACKEND
    ('nccl', 'gloo')
"""

from __future__ import annotations

NCCL_BACKEND = "nccl"
CCL_BACKEND = "ccl"
MPI_BACKEND = "mpi"
GLOO_BACKEND = "gloo"
SCCL_BACKEND = "sccl"
HCCL_BACKEND = "hccl"

COMMS_LOGGER = "comms_logger"
COMMS_LOGGER_ENABLED = "enabled"
COMMS_LOGGER_ENABLED_DEFAULT = False
COMMS_LOGGER_VERBOSE = "verbose"
COMMS_LOGGER_VERBOSE_DEFAULT = False
COMMS_LOGGER_PROF_ALL = "prof_all"
COMMS_LOGGER_PROF_ALL_DEFAULT = True
COMMS_LOGGER_DEBUG = "debug"
COMMS_LOGGER_DEBUG_DEFAULT = False
COMMS_LOGGER_PROF_OPS = "prof_ops"
COMMS_LOGGER_PROF_OPS_DEFAULT: list[str] = []
