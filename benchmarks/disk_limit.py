"""The disk's sequential bandwidth limit on a directory's filesystem (used by ``nvme_offload_bench.py``).

``fio`` when it is installed (one job each: sequential write then read of one file, 64 MiB
blocks; ``direct=1`` with libaio at queue depth 4, and buffered with ``psync``, the write
ending in an fsync and the read starting with the file dropped from the page cache), else GNU
``dd`` (``oflag=direct``/``iflag=direct``, and buffered with ``conv=fdatasync`` and the file
dropped from the page cache with ``iflag=nocache`` before reading). The test file is deleted
afterwards, also on failure.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

BLOCK = 64 << 20


def _fio(path: Path, size: int, rw: str, direct: bool) -> float:
    """Bytes per second of one fio job."""
    engine = ["--ioengine=libaio", "--iodepth=4"] if direct else ["--ioengine=psync"]
    cmd = [
        "fio",
        "--name=limit",
        f"--filename={path}",
        f"--rw={rw}",
        f"--bs={BLOCK}",
        f"--size={size}",
        f"--direct={int(direct)}",
        "--invalidate=1",
        "--output-format=json",
        *engine,
    ]
    if rw == "write":
        cmd.append("--end_fsync=1")
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    job = json.loads(done.stdout[done.stdout.index("{") :])["jobs"][0]
    return float(job[rw if rw == "write" else "read"]["bw_bytes"])


def _dd(path: Path, size: int, rw: str, direct: bool) -> float:
    """Bytes per second of one dd run, timed here (the whole command, fsync included)."""
    count = max(1, size // BLOCK)
    if rw == "write":
        flags = ["oflag=direct"] if direct else ["conv=fdatasync"]
        cmd = ["dd", "if=/dev/zero", f"of={path}", f"bs={BLOCK}", f"count={count}", *flags]
    else:
        if not direct:  # drop the file from the page cache so the buffered read hits the disk
            subprocess.run(["dd", f"if={path}", "iflag=nocache", "count=0"], capture_output=True, check=True)
        flags = ["iflag=direct"] if direct else []
        cmd = ["dd", f"if={path}", "of=/dev/null", f"bs={BLOCK}", *flags]
    t0 = time.perf_counter()
    subprocess.run(cmd, capture_output=True, check=True)
    return count * BLOCK / (time.perf_counter() - t0)


def measure(directory: Path, size: int) -> dict[str, Any]:
    """Sequential write/read bytes per second, direct and buffered, of ``size`` bytes in ``directory``.

    Returns ``{"tool", "file_bytes", "write_direct", "read_direct", "write_buffered", "read_buffered"}``
    (bytes per second), or ``{"tool", "error"}`` when the test could not run.
    """
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "disk_limit.test"
    tool = "fio" if shutil.which("fio") else "dd"
    run = _fio if tool == "fio" else _dd
    result: dict[str, Any] = {"tool": tool, "file_bytes": size}
    try:
        for direct in (True, False):
            kind = "direct" if direct else "buffered"
            result[f"write_{kind}"] = run(path, size, "write", direct)
            result[f"read_{kind}"] = run(path, size, "read", direct)
            path.unlink(missing_ok=True)
    except (subprocess.CalledProcessError, OSError, ValueError, KeyError) as exc:
        stderr = getattr(exc, "stderr", None)
        result["error"] = f"{type(exc).__name__}: {exc}" + (f" ({stderr.strip()[-300:]})" if stderr else "")
    finally:
        path.unlink(missing_ok=True)
    return result
