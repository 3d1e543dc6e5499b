"""DeepSpeed's launcher-environment readers (``deepspeed.comm.utils``): this process's rank, local rank and
world size from the variables the launchers set (torchrun/DeepSpeed's ``RANK``..., else Open MPI's
``OMPI_COMM_WORLD_*``), one process when neither is set; and which managed platform the job runs on.

:func:`shardwise.comm.env.discover_environment` is the full discovery (Slurm, MPICH, Intel MPI and the
launcher's checks); these are DeepSpeed's narrower readers, kept for scripts that call them.

Example:
    >>> get_world_rank_from_launcher({"OMPI_COMM_WORLD_RANK": "3"})
    3
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = [
    "get_local_rank_from_launcher",
    "get_world_rank_from_launcher",
    "get_world_size_from_launcher",
    "in_aml",
    "in_aws_sm",
    "in_dlts",
]


def _first(env: Mapping[str, str] | None, names: tuple[str, str], default: int) -> int:
    env = os.environ if env is None else env
    for name in names:
        if env.get(name) is not None:
            return int(env[name])
    return default


def get_local_rank_from_launcher(env: Mapping[str, str] | None = None) -> int:
    """``LOCAL_RANK``, else ``OMPI_COMM_WORLD_LOCAL_RANK``, else 0."""
    return _first(env, ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"), 0)


def get_world_rank_from_launcher(env: Mapping[str, str] | None = None) -> int:
    """``RANK``, else ``OMPI_COMM_WORLD_RANK``, else 0."""
    return _first(env, ("RANK", "OMPI_COMM_WORLD_RANK"), 0)


def get_world_size_from_launcher(env: Mapping[str, str] | None = None) -> int:
    """``WORLD_SIZE``, else ``OMPI_COMM_WORLD_SIZE``, else 1."""
    return _first(env, ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE"), 1)


def in_aml(env: Mapping[str, str] | None = None) -> bool:
    """Whether the job runs on Azure Machine Learning (``AZUREML_EXPERIMENT_ID`` is set)."""
    return "AZUREML_EXPERIMENT_ID" in (os.environ if env is None else env)


def in_aws_sm(env: Mapping[str, str] | None = None) -> bool:
    """Whether the job runs on AWS SageMaker (``SM_TRAINING_ENV`` is set)."""
    return "SM_TRAINING_ENV" in (os.environ if env is None else env)


def in_dlts(env: Mapping[str, str] | None = None) -> bool:
    """Whether the job runs on DLTS (``DLTS_JOB_ID`` is set)."""
    return "DLTS_JOB_ID" in (os.environ if env is None else env)
