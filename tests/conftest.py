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


@pytest.fixture(autouse=True)
def _no_leaked_process_group():
    """A test that creates the default process group in this process (an in-process ``initialize``
    of a world of one) tears it down, with shardwise's layout, so the tests after it start clean."""
    from shardwise.testing.in_process_group import torn_down_process_group

    with torn_down_process_group():
        yield


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


def _cuda_tests_that_cannot_run(gpu: list[pytest.Item]) -> list[pytest.Item]:
    """All of ``gpu`` where torch sees no GPU; under ``SHARDWISE_GPU_TESTS_ON=cpu`` (the GPU tests'
    logic on the CPU with gloo, for development) only those marked ``cuda(needs_device=True)``."""
    import os

    import torch

    if torch.cuda.is_available():
        return []
    if os.environ.get("SHARDWISE_GPU_TESTS_ON") == "cpu":
        return [item for item in gpu if any(m.kwargs.get("needs_device") for m in item.iter_markers("cuda"))]
    return gpu


def pytest_collection_modifyitems(config, items):
    """``cuda``-marked tests are deselected (not skipped) where they cannot run: a CPU run reports
    them as deselected and spends nothing on them."""
    gpu = [item for item in items if item.get_closest_marker("cuda") is not None]
    dropped = _cuda_tests_that_cannot_run(gpu) if gpu else []
    if not dropped:
        return
    chosen = set(map(id, dropped))
    items[:] = [item for item in items if id(item) not in chosen]
    config.hook.pytest_deselected(items=dropped)


def pytest_collection_finish(session):
    """Module-level reads at import time count too."""
    paths = WATCHER.take()
    if paths:
        raise pytest.UsageError("collecting the tests " + _outside_message(paths))
