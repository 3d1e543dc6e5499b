"""Stage 3 with ``offload_param`` on NVMe: a parameter read between steps (outside
``GatheredParameters``) gives its values; it used to crash the process with SIGSEGV.

The ranks are spawned processes, so a crash fails this test instead of killing pytest.
"""

from __future__ import annotations

import nvme_param_cases as cases
import pytest

from shardwise.testing import run_distributed

pytestmark = pytest.mark.distributed


def test_reading_an_nvme_offloaded_parameter_between_steps(tmp_path):
    for result in run_distributed(cases.read_between_steps, 2, args=(str(tmp_path),), timeout=300):
        assert result["count"] > 0
        assert result["evicted_before"] and result["still_evicted"]  # reading pages in, it does not restore
        assert result["local_nonempty"]
        assert result["outside_equals_inside"]  # the values, and the in-place edit outside was dropped
        assert result["training_unchanged"]
