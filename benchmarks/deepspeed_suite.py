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
side; ``DS_CONTROL=/path/to/python`` adds the control column. ``--junit-dir`` keeps the per-file
JUnit XML for reading single failures.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import sysconfig
import tempfile
import venv
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

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

TOOLS = ("pytest<8.4", "pytest-forked", "pytest-timeout")
"""What DeepSpeed's CPU CI runs its tests with."""


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


def read_junit(path: Path, result: FileResult) -> FileResult:
    """Count the outcomes in one JUnit XML file."""
    root = ET.parse(path).getroot()
    for case in root.iter("testcase"):
        tags = {child.tag for child in case}
        if "error" in tags and not case.get("name"):
            result.error += 1
        elif "failure" in tags:
            result.failed += 1
        elif "error" in tags:
            result.error += 1
        elif "skipped" in tags:
            result.skipped += 1
        else:
            result.passed += 1
    return result


def run_file(python: Path, tests: Path, rel: str, env: dict[str, str], timeout: int, junit: Path) -> FileResult:
    """Run one file as DeepSpeed's CPU CI does and count its outcomes."""
    junit.parent.mkdir(parents=True, exist_ok=True)
    command = [
        str(python), "-m", "pytest", "--forked", f"--timeout={timeout}", "--timeout-method=thread", "-p", "no:cacheprovider",
        "-q", f"--junitxml={junit}", f"unit/{rel}",
    ]
    proc = subprocess.run(command, cwd=tests, env=env, capture_output=True, text=True)
    result = FileResult(rel)
    if junit.exists():
        read_junit(junit, result)
    if result.total == 0:
        tail = (proc.stdout + proc.stderr).strip().splitlines()
        result.note = tail[-1] if tail else f"exit {proc.returncode}"
        result.error = 1
    return result


def run_side(python: Path, tests: Path, files: list[str], env: dict[str, str], timeout: int,
             junit_dir: Path, label: str) -> list[FileResult]:
    """Run every file on one interpreter, printing progress to stderr."""
    results = []
    for rel in files:
        junit = junit_dir / label / (rel.replace("/", "__").removesuffix(".py") + ".xml")
        result = run_file(python, tests, rel, env, timeout, junit)
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
    parser.add_argument("--timeout", type=int, default=600, help="per-test timeout in seconds")
    parser.add_argument("--tools-venv", type=Path, default=REPO / ".deepspeed-suite" / "tools")
    parser.add_argument("--control-python", type=Path, help="an interpreter with real DeepSpeed and the tools")
    parser.add_argument("--no-shardwise", action="store_true", help="run only the control side")
    parser.add_argument("--junit-dir", type=Path, help="keep the JUnit XML here (default: a temporary dir)")
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
        junit_dir = args.junit_dir or Path(scratch) / "junit"
        if not args.no_shardwise:
            site = Path(scratch) / "site"
            install_site(site)
            env = {**base_env, "PYTHONPATH": str(site),
                   "PATH": f"{site / 'bin'}{os.pathsep}{base_env.get('PATH', '')}"}
            python = tools_python(args.tools_venv.resolve())
            columns["shardwise"] = run_side(python, tests, args.files, env, args.timeout, junit_dir, "shardwise")
        if args.control_python:
            columns["deepspeed"] = run_side(
                args.control_python, tests, args.files, base_env, args.timeout, junit_dir, "deepspeed"
            )
    if not columns:
        parser.error("nothing to run: --no-shardwise without --control-python")
    print(table(columns))
    for label, rows in columns.items():
        for r in rows:
            if r.note:
                print(f"{label}: {r.path}: {r.note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
