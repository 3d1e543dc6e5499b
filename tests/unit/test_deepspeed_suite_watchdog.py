"""The DeepSpeed-suite runner ends a session that hangs past every timeout and counts the test as failed."""

from __future__ import annotations

import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import deepspeed_suite  # noqa: E402
from suite_watchdog import run_watched  # noqa: E402


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_watchdog_kills_the_whole_group_of_a_silent_session(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild.pid"
    script = textwrap.dedent(f"""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open({str(pid_file)!r}, "w").write(str(child.pid))
        print("started", flush=True)
        time.sleep(600)
    """)
    begun = time.monotonic()
    run = run_watched([sys.executable, "-c", script], cwd=tmp_path, env=dict(os.environ), limit=3)
    assert run.killed and run.lines == ["started"]
    assert time.monotonic() - begun < 60
    grandchild = int(pid_file.read_text())
    for _ in range(50):  # reaped by init a moment after the kill
        if not _alive(grandchild):
            break
        time.sleep(0.1)
    assert not _alive(grandchild), "the session's spawned process must die with it"


def test_watchdog_leaves_a_talking_session_alone(tmp_path: Path) -> None:
    script = "import time\nfor i in range(4):\n    print(i, flush=True); time.sleep(1)\n"
    run = run_watched([sys.executable, "-c", script], cwd=tmp_path, env=dict(os.environ), limit=3)
    assert not run.killed and run.lines == ["0", "1", "2", "3"] and run.returncode == 0


@pytest.fixture
def fake_pytest(tmp_path: Path) -> Path:
    """An interpreter stand-in: the first session starts a test and hangs silently (ignoring
    SIGALRM and SIGTERM, as a test pytest-timeout cannot end); the rerun, which deselects it,
    passes the other test."""
    fake = tmp_path / "python"
    fake.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import signal, sys, time
        for sig in (signal.SIGALRM, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        if any(a.startswith("--deselect=") for a in sys.argv):
            print("unit/t/test_x.py::test_b PASSED", flush=True)
            print("==== 1 passed, 1 deselected in 0.01s ====", flush=True)
            sys.exit(0)
        print("unit/t/test_x.py::test_a ", end="", flush=True)
        print("Process ForkServerPoolWorker-1:1:", file=sys.stderr, flush=True)  # a child's stderr meanwhile
        time.sleep(600)
    """))
    fake.chmod(0o755)
    return fake


def test_a_hung_test_is_killed_counted_failed_and_the_file_rerun(fake_pytest: Path, tmp_path: Path) -> None:
    tests = tmp_path / "tests"
    (tests / "unit").mkdir(parents=True)
    outcomes: dict[str, str] = {}
    result = deepspeed_suite.run_file(
        fake_pytest, tests, "t/test_x.py", dict(os.environ), timeout=1, outcomes=outcomes, grace=1
    )
    assert outcomes == {"unit/t/test_x.py::test_a": "failed", "unit/t/test_x.py::test_b": "passed"}
    assert (result.passed, result.failed, result.skipped, result.error) == (1, 1, 0, 0)
    assert "killed by the watchdog" in result.note and "test_a" in result.note
