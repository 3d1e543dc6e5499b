"""The shared-memory transport of one host's gloo ranks (:mod:`shardwise.comm.shared_memory`).

- The collectives give exactly the sums taken in rank order (bitwise, at 2 and 3 ranks: rank 2
  sums through its scratch block), leave the other ranges alone, and leave nothing in /dev/shm.
  A releasable buffer gives its pages back and takes them again (a full /dev/shm: a clear error).
- Every rank agrees when one cannot share (no space, another host, the switch off, a /dev/shm of
  its own): no hang, no half-shared group, nothing left behind.
- ZeRO stages 0-2 put their buffers there by default (stage 2: its parameters; its gradient
  buckets stay private), stage 3 its FSDP2 all-gathers and (fp32) reduce-scatters, through a
  staging buffer per rank; all train bit-identically to gloo
  (``SHARDWISE_SHM_COLLECTIVES=0``); when a rank cannot reserve its buffers the engine warns,
  naming the fix, and trains through gloo. (Parity with the single-process reference under both
  transports: test_zero_parity.py.)
"""

from __future__ import annotations

import pytest
import shared_memory_cases as cases
import torch

from shardwise.testing import run_distributed_cases

pytestmark = [pytest.mark.distributed, pytest.mark.numeric]

# the second spans two scratch blocks; the third two of the blocks read between page drops
COLLECTIVE_CASES = [{"shard": 5}, {"shard": (1 << 16) + 3}, {"shard": (1 << 20) + 7, "piece": (1 << 19) + 3}]


@pytest.mark.parametrize("world", [2, 3])
def test_collectives_are_rank_order_sums(world: int) -> None:
    for results in run_distributed_cases(cases.collectives, COLLECTIVE_CASES, world_size=world, timeout=300):
        for rank in results:
            assert rank["leftovers"] == []  # unlinked as soon as every rank mapped them
            assert rank["zeros"]
            for key in (
                "reduce_scatter_mine",
                "reduce_scatter_rest_untouched",
                "all_gather",
                "all_gather_pieces",
                "all_reduce",
                "gather_shards_torch.float32",
                "gather_shards_torch.bfloat16",
                "gather_shards_separate_torch.float32",
                "gather_shards_separate_torch.bfloat16",
                "sum_shards_in_place_False",
                "sum_shards_in_place_True",
                "release_before",
                "released",
                "released_reads_zeros",
                "reserved",
                "reserved_reads_values",
                "full_is_an_error",
            ):
                assert rank[key], key


def test_a_collective_leaves_only_this_ranks_buffer_resident() -> None:
    # 16 MiB per rank: without dropping the other rank's pages the all-reduce would leave it resident too
    for rank in run_distributed_cases(cases.peer_pages, [{"numel": 1 << 22}], world_size=2, timeout=300)[0]:
        assert rank["sums"] and rank["peers_still_readable"]
        assert rank["grew_mib"] < 0.25 * rank["buffer_mib"], rank


REFUSALS = [{"kind": k} for k in ("no_space", "two_hosts", "switched_off", "separate_dirs")]


def test_every_rank_agrees_when_one_cannot_share() -> None:
    runs = run_distributed_cases(cases.refusals, REFUSALS, world_size=2, timeout=300)
    expected = {
        "no_space": "rank 1 could not reserve",
        "two_hosts": "the ranks run on 2 hosts",
        "switched_off": "rank 1: SHARDWISE_SHM_COLLECTIVES=0",
        "separate_dirs": "could not map another rank's buffer",
    }
    for case, ranks in zip(REFUSALS, runs):
        for rank in ranks:
            assert rank["leftovers"] == []
            assert expected[case["kind"]] in rank["result"], (case, rank["result"])


TRAIN_CASES = [
    {"stage": 0, "precision": "fp32", "gas": 2},
    {"stage": 1, "precision": "fp32", "gas": 1},
    {"stage": 1, "precision": "bf16", "gas": 2},
    {"stage": 2, "precision": "fp32", "gas": 2},
    {"stage": 2, "precision": "bf16", "gas": 1, "bucket": 10**8},  # one reduce bucket
    # every parameter sharded (the tiny model's would all stay whole under the default threshold)
    {"stage": 3, "precision": "fp32", "gas": 2, "zero": {"stage3_param_persistence_threshold": 0}},
    {"stage": 3, "precision": "bf16", "gas": 1, "zero": {"stage3_param_persistence_threshold": 0}},
]


@pytest.fixture(scope="module")
def trained():
    return run_distributed_cases(cases.train, TRAIN_CASES, world_size=2, timeout=600)


@pytest.mark.parametrize("index", range(len(TRAIN_CASES)))
def test_every_stage_trains_bit_identically_through_shared_memory(trained, index: int) -> None:
    case = TRAIN_CASES[index]
    for rank in trained[index]:
        shared, gloo, refused = rank["shared"], rank["gloo"], rank["no_space"]
        assert shared["shared_params"] and shared["shared_grads"]  # buffers or FSDP2 units to look at
        assert all(shared["shared_params"]) == (case["stage"] >= 1)  # stage 0 publishes nothing
        # stage 2 keeps no full gradient buffer (its memory saving): it stages one bucket instead;
        # stage 3 reduces through shared memory when FSDP2 reduces in fp32
        assert all(shared["shared_grads"]) == (case["stage"] < 2 or shared.get("reduce_fp32", False))
        if case["stage"] == 2:
            # staged only when the model fits in one reduce bucket; released between steps (the
            # file holds no blocks after the step)
            assert all(shared["staged"]) == ("bucket" in case)
            assert shared["staging_blocks"] == [0] * sum(shared["staged"])
            assert not any(gloo["staged"]) and not any(refused["staged"])
        if case["stage"] == 3 and case["precision"] == "fp32":
            assert shared["reduce_fp32"]
        for other in (gloo, refused):
            assert not any(other["shared_params"]) and not any(other["shared_grads"])
        for other in (gloo, refused):
            assert other["losses"] == shared["losses"]
            assert all(torch.equal(a, b) for a, b in zip(shared["params"], other["params"]))
        assert rank["leftovers"] == []
    logged = trained[index][0]
    assert any("through shared memory" in m for _, m in logged["shared"]["logged"])
    warnings = [m for level, m in logged["no_space"]["logged"] if level >= 30]
    assert any(
        "not shared memory" in m and "--shm-size" in m and "rank 1 could not reserve" in m for m in warnings
    )
    assert not any("shared memory" in m for _, m in logged["gloo"]["logged"])  # the switch: nothing to say
    ranks = trained[index]
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["shared"]["params"], ranks[1]["shared"]["params"]))
