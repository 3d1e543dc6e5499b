"""deepspeed.comm's list, object, point-to-point and coalesced collectives on 2 gloo ranks, each against
torch.distributed's result, and what the comms logger recorded for them."""

from __future__ import annotations

import comm_api_cases as cases
import pytest

from shardwise.testing import run_distributed

pytestmark = pytest.mark.distributed


def test_deepspeed_comm_collectives_match_torch_distributed() -> None:
    for rank, result in enumerate(run_distributed(cases.collectives, world_size=2, timeout=120)):
        for name in ("all_to_all", "all_to_all_async", "gather", "scatter", "all_gather_object",
                     "broadcast_object_list", "batch_isend_irecv", "p2pop_refuses_send", "all_reduce_coalesced",
                     "all_reduce_coalesced_avg", "all_gather_coalesced", "allgather_fn", "reduce_scatter_fn"):
            assert result[name] is True, (rank, name)
        assert result["ranks_of_world"] == [0, 1] and result["ranks_of_group"] == [0, 1]
        assert result["norm_fast"] == 3.0
        # each deepspeed.comm call is logged under DeepSpeed's log name; the flat entry points under the
        # collective that ran; after prof_all=False only prof_ops and prof=True calls are recorded
        assert result["ops"] == sorted([
            "all_to_all", "gather", "scatter", "all_gather_object", "broadcast_object_list",
            "batch_isend_irecv", "all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor",
            "monitored_barrier", "scatter_forced", "all_reduce_forced", "barrier",
        ]), rank
        counts = result["counts"]
        assert counts["all_to_all"] == 2 and counts["all_gather_object"] == 1
        assert counts["all_reduce"] == 2 + 1  # coalesced (as DeepSpeed names it) twice, the fast norm once
        assert counts["all_gather_into_tensor"] == 2 and counts["scatter_forced"] == 1
        assert counts["all_reduce_forced"] == 1 and counts["barrier"] == 1
        assert counts["gather"] == 2 + 1  # the all-gather logged under log_name "gather", a prof_ops entry
        assert result["gather_bytes"] == [12]  # three float32 elements per rank
