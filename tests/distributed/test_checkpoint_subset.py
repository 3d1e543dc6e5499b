"""``save_checkpoint`` on a subset of ranks fails fast with a diagnosis instead of hanging."""

from __future__ import annotations

import pytest
import subset_save_cases

from shardwise.testing import run_distributed

pytestmark = pytest.mark.distributed


def test_save_on_one_rank_fails_fast_naming_the_missing_rank(tmp_path):
    results = run_distributed(
        subset_save_cases.save_on_rank0_only,
        2,
        args=(str(tmp_path / "ckpt"),),
        timeout=240,
        env={"SHARDWISE_TIMEOUT_SECONDS": "120"},
    )
    error = results[0]["error"]
    assert error is not None and "save_checkpoint" in error and "rank 1" in error
    assert results[0]["seconds"] < 60  # a diagnosis, far inside the 120 s collective timeout
    assert not (tmp_path / "ckpt" / "latest").exists()
