"""The tests need nothing beside the checkout: the watcher that enforces it (tests/repo_boundary.py)."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from pathlib import Path

import conftest
from repo_boundary import REPO, Boundary


def test_boundary_allows_the_repository_and_the_given_roots_only(tmp_path: Path) -> None:
    boundary = Boundary(REPO, [tmp_path])
    assert not boundary.outside(str(REPO / "tests" / "data" / "corpus" / "ds_ground_truth.jsonl"))
    assert not boundary.outside(str(tmp_path / "x.json"))
    assert boundary.outside(str(REPO.parent / "shared" / "corpus" / "ds_ground_truth.jsonl"))
    # a sibling whose name starts with the repository's is still outside
    assert boundary.outside(str(REPO.parent / (REPO.name + "-other") / "f.json"))
    # relative paths are taken from the working directory
    cwd = os.getcwd()
    try:
        os.chdir(REPO)
        assert not boundary.outside("tests/conftest.py")
        assert boundary.outside("../shared/hooks/seed-sections.json")
    finally:
        os.chdir(cwd)


def test_a_sibling_of_the_checkout_is_outside_even_inside_an_allowed_root(tmp_path: Path) -> None:
    repo = tmp_path / "clone" / "main"  # a clone in the temporary directory, as CI may make one
    boundary = Boundary(repo, [tmp_path, repo / ".venv"])  # its interpreter inside it
    assert boundary.outside(str(repo.parent / "shared" / "corpus" / "x.json"))
    assert not boundary.outside(str(repo / "tests" / "data" / "x.json"))
    assert not boundary.outside(str(tmp_path / "pytest-of-root" / "t0" / "out.json"))  # the tests' own
    # where the parent holds an allowed root (the repository right in /tmp), the allowed roots decide
    beside_tmp = Boundary(tmp_path / "main", [tmp_path / "work"])
    assert beside_tmp.beside is None
    assert not beside_tmp.outside(str(tmp_path / "work" / "f"))
    assert beside_tmp.outside(str(tmp_path / "other" / "f"))


def test_default_roots_cover_the_interpreter_and_the_temporary_directory() -> None:
    boundary = conftest.WATCHER.boundary  # the session's
    assert not boundary.outside(os.__file__)  # the standard library
    assert not boundary.outside(tempfile.gettempdir() + "/anything")
    assert not boundary.outside(sys.executable)
    assert boundary.outside(str(REPO.parent / "shared"))
    home = Path.home()
    assert not boundary.outside(str(home / ".pdbrc"))  # a tool's setting, present or not
    assert not boundary.outside(str(home / ".cache" / "huggingface" / "x"))
    if not str(REPO).startswith(str(home)):
        assert boundary.outside(str(home / "notes" / "data.json"))


def test_the_session_watcher_records_an_outside_read_and_names_it() -> None:
    outside = REPO.parent / "shardwise-boundary-probe-does-not-exist.json"
    assert conftest.WATCHER.take() == []  # nothing touched so far in this test
    with contextlib.suppress(OSError):  # the audit event fires before the file system answers
        outside.read_text()
    os.listdir(REPO)  # inside: not recorded
    recorded = conftest.WATCHER.take()  # taken here, so this test itself does not fail
    assert recorded == [str(outside)]
    message = conftest._outside_message(recorded)
    assert str(outside) in message and "tests/data/" in message
