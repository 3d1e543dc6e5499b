"""Shared test setup: each test starts with the library logger at its default level, and a test that
touches a file outside the repository fails (``repo_boundary.py``): a fresh clone must pass alone."""

from __future__ import annotations

import logging

import pytest

import repo_boundary
from shardwise.utils.logging import get_logger

WATCHER = repo_boundary.install()


@pytest.fixture(autouse=True)
def _default_log_level():
    logger = get_logger()
    level = logger.level
    logger.setLevel(logging.WARNING)
    yield
    logger.setLevel(level)


def _outside_message(paths: list[str]) -> str:
    listed = "\n  ".join(paths[:10])
    return (
        f"touched {len(paths)} path(s) outside the repository:\n  {listed}\n"
        "fix: put the data the test needs under tests/data/ (the tests must pass with nothing beside "
        "the checkout)"
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Fail the phase (setup, call or teardown) during which a test touched an outside path."""
    outcome = yield
    report = outcome.get_result()
    paths = WATCHER.take()
    if paths and report.outcome != "failed":
        report.outcome = "failed"
        report.longrepr = _outside_message(paths)


def pytest_collection_finish(session):
    """Module-level reads at import time count too."""
    paths = WATCHER.take()
    if paths:
        raise pytest.UsageError("collecting the tests " + _outside_message(paths))
