"""What every node of a launch exports: the env files (``.deepspeed_env`` / ``.shardwise_env``, home
then the working directory, ``DS_ENV_FILE`` renaming DeepSpeed's) and, for remote nodes, the variables
DeepSpeed forwards (prefixes ``NCCL``, ``PYTHON``, ``MLFLOW``, ``MV2``, ``UCX``) and ours
(``SHARDWISE``, ``TORCH_``, ``DEEPSPEED_TIMEOUT``). Pure functions; :mod:`~shardwise.launcher.planner`
puts the result in each node's plan."""

from __future__ import annotations

import os
from collections.abc import Mapping

from shardwise.launcher.resources import parse_env_file

__all__ = ["EXPORT_PREFIXES", "collect_exports", "env_file_paths"]

# DeepSpeed forwards variables with these prefixes to remote nodes (spec 9.4); we add ours.
EXPORT_PREFIXES = ("NCCL", "PYTHON", "MLFLOW", "MV2", "UCX", "SHARDWISE", "TORCH_", "DEEPSPEED_TIMEOUT")
# Never forwarded: they describe this machine or this process, not the job.
_NO_EXPORT = frozenset({"PYTHONHOME", "PYTHONSTARTUP", "PYTHONEXECUTABLE", "SHARDWISE_RUN_DIR"})


def env_file_paths(environ: Mapping[str, str], cwd: str, home: str) -> list[str]:
    """The env files read, lowest precedence first: home then cwd, DeepSpeed's then ours.

    Example:
        >>> env_file_paths({}, "/w", "/h")
        ['/h/.deepspeed_env', '/w/.deepspeed_env', '/h/.shardwise_env', '/w/.shardwise_env']
    """
    ds_name = environ.get("DS_ENV_FILE", "").strip() or ".deepspeed_env"
    paths: list[str] = []
    for name in (ds_name, ".shardwise_env"):
        for base in (home, cwd):
            path = name if os.path.isabs(name) else os.path.join(base, name)
            if path not in paths:
                paths.append(path)
    return paths


def collect_exports(
    environ: Mapping[str, str],
    env_files: Mapping[str, str],
    *,
    remote: bool,
    cwd: str,
) -> dict[str, str]:
    """The variables exported on every node.

    Args:
        environ: this machine's environment.
        env_files: ``{path: text}`` of the env files that exist, lowest precedence first.
        remote: whether nodes start through ssh/pdsh/mpi/slurm (then prefixed variables
            and a ``PYTHONPATH`` starting with ``cwd`` are forwarded, as DeepSpeed does);
            local nodes inherit this environment anyway.
        cwd: the working directory.

    Raises:
        ValueError: a malformed env file line (the message names the file and line).

    Example:
        >>> collect_exports({"NCCL_DEBUG": "INFO", "HOME": "/h"}, {"x": "A=1"}, remote=True, cwd="/w")
        {'NCCL_DEBUG': 'INFO', 'PYTHONPATH': '/w', 'A': '1'}
    """
    exports: dict[str, str] = {}
    if remote:
        skip = {"NCCL_IB_HCA", "UCX_NET_DEVICES"} if environ.get("AISC_JOB_NAME") else set()
        for key, value in environ.items():
            if key.startswith(EXPORT_PREFIXES) and key not in _NO_EXPORT and key not in skip:
                exports[key] = value
        existing = environ.get("PYTHONPATH", "")
        exports["PYTHONPATH"] = f"{cwd}:{existing}" if existing else cwd
    for path, text in env_files.items():
        exports.update(parse_env_file(text, source=path))
    return exports
