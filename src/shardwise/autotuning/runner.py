"""One experiment through our own launcher: the command, the run, and how it ended.

An experiment is ``python -m shardwise.launcher [the launcher options] script [script args]``
with the script's ``--deepspeed_config`` pointing at the experiment's file and, through
``arg_mappings``, the script's own arguments set from the experiment's config (e.g.
``{"train_micro_batch_size_per_gpu": "--batch_size"}``). It runs in its own process group,
is killed whole after the timeout, and its output goes to the experiment's folder.

Example:
    >>> replace_config_arg(["--deepspeed", "--deepspeed_config", "a.json", "--lr", "1"], "b.json")
    ['--deepspeed', '--deepspeed_config', 'b.json', '--lr', '1']
    >>> apply_arg_mappings(["--bs", "4"], {"train_micro_batch_size_per_gpu": "--bs"},
    ...                    {"train_micro_batch_size_per_gpu": 16})
    ['--bs', '16']
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from shardwise.autotuning.records import FAILED, OK, OOM, TIMEOUT

__all__ = ["ExperimentLaunch", "Outcome", "apply_arg_mappings", "replace_config_arg", "run_launch"]

CONFIG_FLAGS = ("--deepspeed_config", "--deepspeed-config")
OOM_SIGNS = (
    "out of memory",
    "outofmemoryerror",
    "cannot allocate memory",
    "memoryerror",
    "std::bad_alloc",
    "sigkill",
)
"""Signs of an out-of-memory end in an experiment's stderr (SIGKILL: usually the kernel's OOM killer)."""


def replace_config_arg(user_args: Sequence[str], path: str) -> list[str]:
    """The script's arguments with ``--deepspeed_config`` set to ``path`` (added when absent)."""
    out = list(user_args)
    for i, arg in enumerate(out):
        if arg in CONFIG_FLAGS and i + 1 < len(out):
            out[i + 1] = path
            return out
        for flag in CONFIG_FLAGS:
            if arg.startswith(flag + "="):
                out[i] = f"{flag}={path}"
                return out
    return [*out, "--deepspeed_config", path]


def _lookup(config: Mapping[str, object], dotted: str) -> object:
    node: object = config
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            raise KeyError(dotted)
        node = node[part]
    return node


def apply_arg_mappings(
    user_args: Sequence[str], mappings: Mapping[str, str] | None, ds_config: Mapping[str, object]
) -> list[str]:
    """Set each mapped script argument to the config key's value (``"a.b"`` reaches nested keys).

    Raises:
        ValueError: a mapped key is not in the experiment's config.
    """
    out = list(user_args)
    for key, flag in (mappings or {}).items():
        try:
            value = str(_lookup(ds_config, key))
        except KeyError:
            raise ValueError(
                f"autotuning.arg_mappings: {key!r} (mapped to {flag!r}) is not a key of the experiment's config; "
                "map keys the tuning sets, e.g. train_micro_batch_size_per_gpu or gradient_accumulation_steps"
            ) from None
        for i, arg in enumerate(out):
            if arg == flag and i + 1 < len(out):
                out[i + 1] = value
                break
            if arg.startswith(flag + "="):
                out[i] = f"{flag}={value}"
                break
        else:
            out += [flag, value]
    return out


@dataclass(frozen=True)
class ExperimentLaunch:
    """How to launch the user's script.

    Attributes:
        launcher_args: the launcher options (``--autotuning`` and its own options removed).
        user_script: the training script.
        user_args: its arguments as given.
        arg_mappings: ``autotuning.arg_mappings``.
        timeout_s: seconds before an experiment is stopped.
    """

    launcher_args: tuple[str, ...]
    user_script: str
    user_args: tuple[str, ...]
    arg_mappings: Mapping[str, str] | None = None
    timeout_s: float = 900.0

    def script_args(self, config_path: str, ds_config: Mapping[str, object]) -> list[str]:
        """The script's arguments for one experiment."""
        return apply_arg_mappings(
            replace_config_arg(self.user_args, config_path), self.arg_mappings, ds_config
        )

    def command(self, config_path: str, ds_config: Mapping[str, object]) -> list[str]:
        """The full command line of one experiment."""
        return [
            sys.executable,
            "-m",
            "shardwise.launcher",
            *self.launcher_args,
            self.user_script,
            *self.script_args(config_path, ds_config),
        ]


@dataclass(frozen=True)
class Outcome:
    """How a launch ended: ``ok``/``failed``/``oom``/``timeout``, an error summary, wall seconds."""

    status: str
    error: str
    seconds: float


def _tail(path: str, chars: int = 1500) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.read()[-chars:]
    except OSError:
        return ""


def run_launch(command: Sequence[str], folder: str, timeout_s: float, expect: str) -> Outcome:
    """Run ``command`` with output in ``folder``; ``ok`` only when it exits 0 and wrote ``expect``."""
    stdout_path, stderr_path = os.path.join(folder, "stdout.log"), os.path.join(folder, "stderr.log")
    began = time.perf_counter()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(stdout_path, "w", encoding="utf-8") as out, open(stderr_path, "w", encoding="utf-8") as err:
        process = subprocess.Popen(list(command), stdout=out, stderr=err, env=env, start_new_session=True)
        try:
            code = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            return Outcome(TIMEOUT, f"stopped after {timeout_s:g}s", time.perf_counter() - began)
    seconds = time.perf_counter() - began
    if code == 0 and os.path.isfile(expect):
        return Outcome(OK, "", seconds)
    tail = _tail(stderr_path)
    if any(sign in tail.lower() for sign in OOM_SIGNS) or code in (-9, 137):
        return Outcome(OOM, f"exit {code}, out of memory: ...{tail[-600:]}", seconds)
    if code == 0:
        return Outcome(
            FAILED,
            f"the script ended (exit 0) without writing {os.path.basename(expect)}: it stopped before "
            "autotuning.end_profile_step optimizer steps; let it run longer or lower end_profile_step",
            seconds,
        )
    return Outcome(FAILED, f"exit {code}: ...{tail[-600:]}", seconds)
