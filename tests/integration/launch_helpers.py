"""Running the ``shardwise`` command in subprocesses on 127.0.0.1 for the integration tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
DIST_MODES = SCRIPTS / "dist_modes.py"
EXAMPLE = REPO / "examples" / "train_gpt.py"
EXAMPLE_CONFIG = REPO / "examples" / "configs" / "zero2_bf16.json"


@dataclass(frozen=True)
class Result:
    """A finished command: exit code, output and wall time."""

    returncode: int
    stdout: str
    stderr: str
    seconds: float


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def shardwise_command() -> list[str]:
    """The installed ``shardwise`` console script next to this interpreter, else the module."""
    script = Path(sys.executable).with_name("shardwise")
    return [str(script)] if script.exists() else [sys.executable, "-m", "shardwise.cli.main"]


def environment(cwd: Path, **env: str) -> dict[str, str]:
    """This environment with the repo's sources first on the path and a private HOME (no stray env files)."""
    environ = dict(os.environ)
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), environ.get("PYTHONPATH", "")]))
    environ["HOME"] = str(cwd)
    environ.pop("CUDA_VISIBLE_DEVICES", None)
    environ.update(env)
    return environ


def run(argv: list[str], cwd: Path, timeout: float = 280.0, **env: str) -> Result:
    """Run ``argv`` in :func:`environment` and wait for it."""
    environ = environment(cwd, **env)
    start = time.monotonic()
    process = subprocess.Popen(
        argv, cwd=cwd, env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # SIGTERM first: the launcher forwards it and stops its node agents (SIGKILL would orphan them).
        process.send_signal(signal.SIGTERM)
        try:
            stdout, stderr = process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            stdout, stderr = process.communicate()
        raise AssertionError(f"{argv} did not finish within {timeout:g}s:\n{stderr[-4000:]}") from None
    return Result(process.returncode, stdout, stderr, time.monotonic() - start)


def summary(result: Result) -> str:
    """The launcher's closing failure summary (from its first line)."""
    marker = "======== shardwise:"
    assert marker in result.stderr, f"no failure summary in:\n{result.stderr[-4000:]}"
    return result.stderr[result.stderr.index(marker) :]
