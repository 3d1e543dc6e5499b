"""Shared test setup: each test starts with the library logger at its default level."""

from __future__ import annotations

import logging

import pytest

from shardwise.utils.logging import get_logger


@pytest.fixture(autouse=True)
def _default_log_level():
    logger = get_logger()
    level = logger.level
    logger.setLevel(logging.WARNING)
    yield
    logger.setLevel(level)
