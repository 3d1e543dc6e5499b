"""Run DeepSpeed's own unit tests against shardwise's ``deepspeed`` package (and, optionally, real DeepSpeed).

DeepSpeed's tests are the measure of "drop-in": this script takes a DeepSpeed source checkout's
``tests`` directory (kept OUTSIDE this repository; the tests are not on the package registry and are
never copied here) and runs the chosen files the way DeepSpeed's CPU CI does (``pytest --forked``,
pytest < 8.4, a per-test timeout, DeepSpeed's own ``pytest.ini`` markers), then prints one row per
file: passed / failed / skipped / error.

* shardwise side: ``shardwise compat install-deepspeed --target <tmp site>`` writes the compatibility
  package into a throwaway directory; the tests run on this project's interpreter with that directory
  first on ``PYTHONPATH`` and the test tools from a side venv (``.deepspeed-suite/tools``, created
  once and reused; ignored by git) whose site directory adds this project's.
* control side (``--control-python /path/to/venv/bin/python``): the same files on an interpreter that
  has real DeepSpeed 0.19.8 and the same tools installed.

``make deepspeed-suite DS_TESTS=/path/to/DeepSpeed/tests`` runs the default 27 files on the shardwise
side; ``DS_CONTROL=/path/to/python`` adds the control column. ``--outcomes FILE`` writes every test's outcome
per side as JSON, and ``--compare-with FILE`` (such a file from a control run) lists the tests the control
side passes and shardwise does not.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import sysconfig
import tempfile
import venv
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from suite_watchdog import run_watched  # noqa: E402  (a sibling script module, not a package)

WATCHDOG_GRACE = 60
"""Seconds past pytest-timeout's limit (twice the per-test timeout) before the watchdog kills a session."""

DEFAULT_FILES = (
    "runtime/test_ds_initialize.py",
    "runtime/test_ds_config_dict.py",
    "runtime/test_ds_config_model.py",
    "runtime/test_lr_schedulers.py",
    "runtime/test_runtime_utils.py",
    "runtime/half_precision/test_fp16.py",
    "runtime/half_precision/test_dynamic_loss_scale.py",
    "v1/half_precision/test_bf16.py",
    "v1/zero/test_zero.py",
    "runtime/zero/test_zero_context.py",
    "runtime/zero/test_zero_context_return.py",
    "runtime/zero/test_zero_context_ancestry.py",
    "runtime/zero/test_zero_config.py",
    "checkpoint/test_zero_optimizer.py",
    "checkpoint/test_latest_checkpoint.py",
    "checkpoint/test_other_optimizer.py",
    "checkpoint/test_lr_scheduler.py",
    "runtime/activation_checkpointing/test_activation_checkpointing.py",
    "monitor/test_monitor.py",
    "elasticity/test_elastic.py",
    "launcher/test_ds_arguments.py",
    "launcher/test_run.py",
    "launcher/test_user_args.py",
    "utils/test_groups.py",
    "utils/test_partition_balanced.py",
    "utils/test_init_on_device.py",
    "utils/test_get_optim_files.py",
)
"""The files of issue 38: the ones that exercise DeepSpeed's public training API (relative to ``tests/unit``)."""

TOOLS = ("pytest<8.4", "pytest-forked", "pytest-timeout", "py-cpuinfo")
"""What DeepSpeed's CPU CI runs its tests with, and py-cpuinfo, which its ops tests import (``cpuinfo``;
DeepSpeed installs it as a dependency, so the control side has it)."""


@dataclass
class FileResult:
    """One test file's outcome counts; ``note`` says why a file has no test results (collection error)."""

    path: str
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    error: int = 0
    note: str = ""

    @property
    def total(self) -> int:
        return self.passed + self.failed + self.skipped + self.error


def tools_python(cache: Path) -> Path:
    """The side venv with the test tools (created on first use), its site adding this interpreter's."""
    python = cache / "bin" / "python"
    if not python.exists():
        venv.EnvBuilder(with_pip=True).create(cache)
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", *TOOLS], check=True)
        site = subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True, capture_output=True, text=True,
        ).stdout.strip()
        project_site = sysconfig.get_paths()["purelib"]
        Path(site, "zz_shardwise_project.pth").write_text(f"import site; site.addsitedir({project_site!r})\n")
    return python


def install_site(target: Path) -> None:
    """Write shardwise's ``deepspeed`` package into ``target``."""
    subprocess.run(
        [sys.executable, "-m", "shardwise.cli.main", "compat", "install-deepspeed", "--target", str(target)],
        check=True, capture_output=True,
    )


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_OUTCOME = re.compile(r"^(unit/\S+?::\S.*?) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b")
_STARTED = re.compile(r"^(unit/\S+?::\S.*?) ?$")  # stdout only: a child's stderr never runs into it
_FINISHED = re.compile(r"^=+ .*\b(passed|failed|skipped|error|errors|deselected|no tests ran)\b.* in [0-9.]+s")
_COUNTED = {"PASSED": "passed", "XPASS": "passed", "FAILED": "failed", "SKIPPED": "skipped", "XFAIL": "skipped",
            "ERROR": "error"}


def run_file(python: Path, tests: Path, rel: str, env: dict[str, str], timeout: int,
             outcomes: dict[str, str], grace: float = WATCHDOG_GRACE, log: Path | None = None) -> FileResult:
    """Run one file as DeepSpeed's CPU CI does, filling ``outcomes`` (test id -> outcome), and count them.

    A test that hangs past pytest-timeout ends the whole session under ``--forked``; one that hangs
    where pytest-timeout cannot reach is ended by the watchdog (:func:`suite_watchdog.run_watched`: the
    session's process group killed after ``2 * timeout + grace`` seconds without output). Either
    way the file is then run again without the tests already reported, the hung one counted as failed,
    until the session ends.
    """
    env = {**env, "DS_UNITTEST_TIMEOUT": str(timeout)}  # DistributedTest's own limit: a clean failure
    note = ""
    while True:
        command = [str(python), "-m", "pytest", "--forked", f"--timeout={2 * timeout}", "-p", "no:cacheprovider",
                   "-v", "-rN", f"unit/{rel}", *(f"--deselect={test}" for test in outcomes)]
        proc = run_watched(command, cwd=tests, env=env, limit=2 * timeout + grace)
        lines = [_ANSI.sub("", line) for line in proc.lines]
        if log is not None:  # every session's raw output, for the first error of each failure
            with log.open("a") as sink:
                sink.write(f"### {python} {rel}\n" + "\n".join(lines) + "\n")
        running, finished, before = None, False, len(outcomes)
        for line in lines:
            if match := _OUTCOME.match(line):
                outcomes[match.group(1)] = _COUNTED[match.group(2)]
                running = None
            elif match := _STARTED.match(line):
                running = match.group(1)
            elif _FINISHED.match(line):
                finished = True
                if len(outcomes) == before:  # skipped or failed while collecting: only the summary counts them
                    for count, word in re.findall(r"(\d+) (skipped|error|errors)\b", line):
                        for i in range(int(count)):
                            outcomes[f"unit/{rel}::<collection {word.rstrip('s')} {i}>"] = word.rstrip("s")
        if proc.killed and running is None:  # killed between tests: nothing to blame, nothing to rerun
            note = f"{note}; " if note else ""
            note += "session killed by the watchdog between tests"
            break
        if (finished and not proc.killed) or running is None:
            if proc.returncode not in (0, 5) and not any(o != "skipped" for o in outcomes.values()):  # say why
                reasons = [ln for ln in lines if ln.startswith("E ")] or [ln for ln in lines if ln.strip()]
                note = reasons[-1].strip() if reasons else f"exit {proc.returncode}"
            break
        outcomes[running] = "failed"  # hung past the timeout
        note = f"{note}; " if note else ""
        how = "killed by the watchdog" if proc.killed else "ended the session"
        note += f"hung ({how}): {running.split('::', 1)[1]}"
    result = FileResult(rel, note=note)
    for outcome in outcomes.values():
        setattr(result, outcome, getattr(result, outcome) + 1)
    if result.total == 0 or (not outcomes and proc.returncode not in (0, 5)):
        result.error += 1
    return result


def run_side(python: Path, tests: Path, files: list[str], env: dict[str, str], timeout: int,
             outcomes: dict[str, str], label: str, log: Path | None = None) -> list[FileResult]:
    """Run every file on one interpreter, printing progress to stderr; ``outcomes`` gets every test's."""
    results = []
    for rel in files:
        per_file: dict[str, str] = {}
        result = run_file(python, tests, rel, env, timeout, per_file, log=log)
        outcomes.update(per_file)
        print(f"[{label}] {rel}: {result.passed} passed, {result.failed} failed, {result.skipped} skipped, "
              f"{result.error} error {result.note}", file=sys.stderr, flush=True)
        results.append(result)
    return results


def table(columns: dict[str, list[FileResult]]) -> str:
    """The per-file table, one ``pass/fail/skip/err`` group per side, and the totals."""
    labels = list(columns)
    files = [r.path for r in columns[labels[0]]]
    width = max(len(f) for f in files)
    head = f"{'file':<{width}}" + "".join(f" | {label + ' p/f/s/e':>22}" for label in labels)
    lines = [head, "-" * len(head)]
    for i, path in enumerate(files):
        cells = "".join(
            f" | {f'{r.passed}/{r.failed}/{r.skipped}/{r.error}':>22}" for r in (columns[lb][i] for lb in labels)
        )
        lines.append(f"{path:<{width}}{cells}")
    totals = ""
    for label in labels:
        rows = columns[label]
        counts = [sum(getattr(r, k) for r in rows) for k in ("passed", "failed", "skipped", "error")]
        totals += f" | {'/'.join(map(str, counts)):>22}"
    lines.append("-" * len(head))
    lines.append(f"{'total (passed/failed/skipped/error)':<{width}}{totals}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ds-tests", required=True, type=Path, help="a DeepSpeed checkout's tests/ directory")
    parser.add_argument("--files", nargs="*", default=list(DEFAULT_FILES), help="files under tests/unit")
    parser.add_argument("--timeout", type=int, default=600,
                        help="per-test timeout in seconds (DeepSpeed's DS_UNITTEST_TIMEOUT; pytest-timeout at twice it)")
    parser.add_argument("--tools-venv", type=Path, default=REPO / ".deepspeed-suite" / "tools")
    parser.add_argument("--control-python", type=Path, help="an interpreter with real DeepSpeed and the tools")
    parser.add_argument("--no-shardwise", action="store_true", help="run only the control side")
    parser.add_argument("--outcomes", type=Path, help="write {side: {test id: outcome}} as JSON here")
    parser.add_argument("--log", type=Path, help="append every pytest session's output here (failures' tracebacks)")
    parser.add_argument("--compare-with", type=Path,
                        help="an --outcomes file with a 'deepspeed' side: list what it passes and shardwise does not")
    args = parser.parse_args(argv)
    tests = args.ds_tests.resolve()
    if not (tests / "unit").is_dir() or not (tests / "conftest.py").exists():
        parser.error(f"--ds-tests {tests}: expected a DeepSpeed checkout's tests/ directory (with unit/ and conftest.py)")
    if REPO in tests.parents or tests == REPO:
        parser.error(f"--ds-tests {tests} is inside this repository; keep DeepSpeed's tests outside it")
    base_env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    base_env.pop("PYTHONPATH", None)
    columns: dict[str, list[FileResult]] = {}
    with tempfile.TemporaryDirectory(prefix="deepspeed-suite-") as scratch:
        outcomes: dict[str, dict[str, str]] = {}
        if not args.no_shardwise:
            site = Path(scratch) / "site"
            install_site(site)
            env = {**base_env, "PYTHONPATH": str(site),
                   "PATH": f"{site / 'bin'}{os.pathsep}{base_env.get('PATH', '')}"}
            python = tools_python(args.tools_venv.resolve())
            outcomes["shardwise"] = {}
            columns["shardwise"] = run_side(python, tests, args.files, env, args.timeout, outcomes["shardwise"],
                                            "shardwise", args.log)
        if args.control_python:
            columns["deepspeed"] = run_side(
                args.control_python, tests, args.files, base_env, args.timeout,
                outcomes.setdefault("deepspeed", {}), "deepspeed", args.log
            )
    if not columns:
        parser.error("nothing to run: --no-shardwise without --control-python")
    print(table(columns))
    if args.outcomes:
        args.outcomes.write_text(json.dumps(outcomes, indent=1, sort_keys=True))
    if args.compare_with:
        control = json.loads(args.compare_with.read_text())["deepspeed"]
        mine = outcomes.get("shardwise", {})
        passed = [t for t, o in control.items() if o == "passed"]
        missing = sorted(t for t in passed if mine.get(t) != "passed")
        print(f"deepspeed passes {len(passed)}; shardwise passes {len(passed) - len(missing)} of them "
              f"({100 * (len(passed) - len(missing)) / max(1, len(passed)):.1f}%); not passed by shardwise:")
        for test in missing:
            print(f"  {mine.get(test, 'not run')}: {test}")
    for label, rows in columns.items():
        for r in rows:
            if r.note:
                print(f"{label}: {r.path}: {r.note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
