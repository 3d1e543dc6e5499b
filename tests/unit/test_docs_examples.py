"""Every page under ``docs/`` shows a runnable example, and every such example runs.

A runnable example is a ```` ```python ```` block right after a ``<!-- test: run -->`` comment
(invisible on the rendered page). ``<!-- test: run nproc=2 -->`` runs it as
``python -m torch.distributed.run --standalone --nproc_per_node 2 example.py``, as the page
tells the reader to. Each example runs in a fresh temporary directory in which ``examples/``
and ``benchmarks/`` are links to the repository's, so a page can use the bundled configs by
the same relative path a reader uses from the repository root. An example asserts what it
shows (the loss went down, the checkpoint reloads equal), so a broken feature fails here.

The README is checked too: its runnable examples run the same way, it has at most 150 lines,
every relative link resolves, and every docs page is reachable from it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
README = REPO / "README.md"

# Reference pages with nothing to run: the architecture map, the table of defaults, and the report of
# the last DeepSpeed-suite run (its command needs a DeepSpeed checkout kept outside the repository).
NO_EXAMPLE = {"architecture.md", "config-defaults.md", "deepspeed-suite.md"}

README_MAX_LINES = 150
EXAMPLE_TIMEOUT_S = 180

_RUNNABLE = re.compile(r"<!-- test: run(?: nproc=(\d+))? -->[ \t]*\n```python\n(.*?)^```", re.S | re.M)
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")

PAGES = sorted(DOCS.glob("*.md"))


def runnable_examples(text: str) -> list[tuple[int, str]]:
    """The (process count, code) of every runnable example in a page's markdown."""
    return [(int(nproc or 1), code) for nproc, code in _RUNNABLE.findall(text)]


def relative_links(text: str) -> list[str]:
    """Link targets that point into the repository (no scheme, no bare anchor), anchors cut."""
    targets = []
    for target in _LINK.findall(text):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        targets.append(target.split("#", 1)[0])
    return targets


def test_marker_syntax_is_found():
    page = "text\n<!-- test: run nproc=2 -->\n```python\nprint(1)\n```\n\n```python\nnot run\n```\n"
    assert runnable_examples(page) == [(2, "print(1)\n")]
    assert relative_links("[a](docs/x.md#y) [b](https://e.org) [c](#top)") == ["docs/x.md"]


def test_there_are_docs_pages():
    assert {p.name for p in PAGES} >= NO_EXAMPLE | {"zero.md", "checkpoints.md", "launcher.md"}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_page_links_resolve(page: Path) -> None:
    missing = [t for t in relative_links(page.read_text()) if not (page.parent / t).exists()]
    assert not missing, f"{page.name} links to missing files: {missing}"


@pytest.mark.parametrize("page", [p for p in PAGES if p.name not in NO_EXAMPLE], ids=lambda p: p.name)
def test_page_has_a_runnable_example(page: Path) -> None:
    assert runnable_examples(page.read_text()), (
        f"docs/{page.name} has no runnable example: put '<!-- test: run -->' on the line before a "
        "```python block that shows the feature and asserts what it does"
    )


@pytest.mark.parametrize("page", [README, *PAGES], ids=lambda p: p.name)
def test_every_marker_marks_a_python_block(page: Path) -> None:
    text = page.read_text()
    assert text.count("<!-- test:") == len(runnable_examples(text)), (
        f"{page.name}: a '<!-- test: run -->' marker is not directly followed by a ```python block "
        "(or is misspelt), so its example would not run"
    )


def _example_cases() -> list:
    cases = []
    for page in [README, *PAGES]:
        for index, (nproc, code) in enumerate(runnable_examples(page.read_text())):
            cases.append(pytest.param(nproc, code, id=f"{page.stem}-{index}"))
    return cases


@pytest.mark.integration  # each example is a fresh process (some launch ranks or the CLI)
@pytest.mark.parametrize(("nproc", "code"), _example_cases())
def test_docs_example_runs(nproc: int, code: str, tmp_path: Path) -> None:
    for shared in ("examples", "benchmarks"):
        (tmp_path / shared).symlink_to(REPO / shared, target_is_directory=True)
    script = tmp_path / "example.py"
    script.write_text(code)
    if nproc == 1:
        command = [sys.executable, str(script)]
    else:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            str(script),
        ]
    # as in an activated venv: its `shardwise` command on PATH
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "src"), "PATH": path}
    done = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=EXAMPLE_TIMEOUT_S
    )
    assert done.returncode == 0, (
        f"example failed (exit {done.returncode}):\n{code}\n--- stdout\n{done.stdout[-3000:]}\n"
        f"--- stderr\n{done.stderr[-6000:]}"
    )


def test_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines, at most {README_MAX_LINES}"


def test_readme_has_a_runnable_example():
    assert runnable_examples(README.read_text()), (
        "README.md's short example should be marked <!-- test: run -->"
    )


def test_readme_links_resolve():
    missing = [t for t in relative_links(README.read_text()) if not (REPO / t).exists()]
    assert not missing, f"README.md links to missing files: {missing}"


def test_readme_links_every_docs_page():
    linked = {(REPO / t).resolve() for t in relative_links(README.read_text())}
    unlinked = [p.name for p in PAGES if p.resolve() not in linked]
    assert not unlinked, f"README.md does not link these docs pages: {unlinked}"
