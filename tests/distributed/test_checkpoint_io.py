"""Atomic and asynchronous saves, tag validation and the 16-bit model file, on gloo ranks."""

from __future__ import annotations

import checkpoint_cases as cases
import pytest

from shardwise.testing import DistributedTestError, run_distributed, run_distributed_cases

pytestmark = pytest.mark.distributed


def test_two_rank_io_behaviours(tmp_path):
    names = ["interrupted", "async", "tag_fail", "16bit", "api"]
    results = run_distributed_cases(
        cases.io_case, [{"name": n, "dir": str(tmp_path / n)} for n in names], world_size=2, timeout=600
    )
    interrupted, asynchronous, tag_fail, sixteen, api = results
    for result in interrupted:
        # the injected write error on rank 1 is raised on every rank...
        assert result["error"] is not None and "injected: disk full" in result["error"]
        # ...and nothing moved: 'latest' still names A, B was never published, A loads exactly
        assert result["latest"] == "A" and not result["has_b"]
        assert result["path"].endswith("/A") and result["restored"] and result["steps"] == 2
    for result in asynchronous:
        assert result["restored"] and result["same_losses"] and result["latest"] == "global_step3"
    for message in tag_fail:
        assert "not consistent across all ranks" in message
    for result in sixteen:
        assert result == {"ok": True, "pt_equal": True, "st_equal": True}

    for result in api:
        assert result["no_latest"] == (None, None)  # DeepSpeed's answer when there is no 'latest'
        assert result["latest"] == "kept"  # save_latest=False left it alone
        assert result["module_only"] == {"params": True, "steps": 0, "lr_untouched": True, "scheduler": -1}
        assert result["no_optimizer"] == {
            "params": True,
            "state_empty": True,
            "steps": 3,
            "lr_untouched": True,
        }
        assert (
            "extra_buffer" in result["strict_error"] and "load_module_strict=False" in result["strict_error"]
        )
        assert result["non_strict_params"] and result["frozen_excluded"] and result["export_equal"]
        assert sorted(result["info"]) == [("kept", 2, 2, 3), ("side", 2, 2, 3)]


def test_a_process_killed_mid_save_leaves_the_previous_checkpoint(tmp_path):
    root = str(tmp_path)
    with pytest.raises(DistributedTestError, match="exit code 17"):
        run_distributed(cases.save_then_killed, 1, args=(root,), timeout=300)
    assert (tmp_path / ".B.partial").is_dir() and not (tmp_path / "B").exists()
    (result,) = run_distributed(cases.load_after_kill, 1, args=(root,), timeout=300)
    assert result["latest"] == "A" and result["path"].endswith("/A") and result["restored"]
