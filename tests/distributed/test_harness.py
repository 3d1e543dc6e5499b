"""Tests of the multi-process harness in ``shardwise.testing``.

The functions the ranks run must be importable by the rank processes, so they live at
module level here. Each run costs the process group's set-up in every rank, so the tests are
few and the slow paths use short timeouts.
"""

from __future__ import annotations

import os
import socket
import sys
import time

import pytest

from shardwise.testing import DistributedTestError, find_free_port, run_distributed, run_distributed_cases
from shardwise.testing.multiprocess import _available_cpus

# --------------------------------------------------------------------------------------
# Functions run on the ranks.
# --------------------------------------------------------------------------------------


def _all_reduce_rank_plus_one(rank: int, world_size: int, payload_numel: int = 0) -> dict:
    import torch
    import torch.distributed as dist

    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    return {
        "rank": rank,
        "dist_rank": dist.get_rank(),
        "sum": value.item(),
        "env": {
            k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR")
        },
        "threads": torch.get_num_threads(),
        "extra_env": os.environ.get("SHARDWISE_HARNESS_TEST"),
        # A result far bigger than a pipe buffer: must come back without deadlocking.
        "payload": torch.full((payload_numel,), float(rank)),
    }


def _explode_on_rank_one(rank: int, world_size: int) -> None:
    import torch
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("boom from rank 1")
    # Rank 0 waits for a partner that never comes: only the harness can end this early.
    dist.all_reduce(torch.ones(1))


def _rank_one_skips_the_all_reduce(rank: int, world_size: int) -> None:
    import torch
    import torch.distributed as dist

    if rank == 0:
        dist.all_reduce(torch.ones(1))
    else:
        time.sleep(600)  # off doing something else, never joins the collective


def _rank_zero_stuck_in_python(rank: int, world_size: int) -> int:
    if rank == 0:
        _sleep_forever_here()
    return rank


def _sleep_forever_here() -> None:
    time.sleep(600)


def _exit_three_on_rank_one(rank: int, world_size: int) -> None:
    import torch.distributed as dist

    if rank == 1:
        os._exit(3)
    dist.barrier()


def _scaled_all_reduce(rank: int, world_size: int, case: dict) -> tuple[int, float]:
    import torch
    import torch.distributed as dist

    value = torch.tensor([case["scale"] * (rank + 1)])
    dist.all_reduce(value)
    return os.getpid(), value.item()


# --------------------------------------------------------------------------------------
# Tests.
# --------------------------------------------------------------------------------------


def test_find_free_port_is_bindable() -> None:
    port = find_free_port()
    assert 1024 <= port < 65536
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))


def test_unpicklable_function_is_rejected_before_spawning() -> None:
    start = time.monotonic()
    with pytest.raises(ValueError, match="module level"):
        run_distributed(lambda rank, world_size: rank)
    assert time.monotonic() - start < 1.0


@pytest.mark.distributed
def test_all_reduce_on_four_ranks_with_launcher_env_and_a_large_result() -> None:
    numel = 1_000_000  # 4 MB per rank, far beyond a pipe buffer
    results = run_distributed(
        _all_reduce_rank_plus_one, 4, kwargs={"payload_numel": numel}, env={"SHARDWISE_HARNESS_TEST": "yes"}
    )
    assert [r["rank"] for r in results] == [0, 1, 2, 3]  # ordered by rank
    for rank, result in enumerate(results):
        assert result["dist_rank"] == rank
        assert result["sum"] == 10.0  # 1 + 2 + 3 + 4
        assert result["env"] == {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "4",
            "LOCAL_WORLD_SIZE": "4",
            "MASTER_ADDR": "127.0.0.1",
        }
        assert result["extra_env"] == "yes"
        assert result["threads"] == max(1, len(os.sched_getaffinity(0)) // 4)
        assert result["payload"].shape == (numel,)
        assert bool((result["payload"] == rank).all())


@pytest.mark.distributed
def test_raising_rank_reports_its_traceback_and_the_others_are_killed_promptly() -> None:
    start = time.monotonic()
    # The collective timeout is 60 s here, so finishing well before it proves that the
    # harness killed rank 0 instead of waiting for gloo to give up.
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_explode_on_rank_one, 2, timeout=120.0)
    elapsed = time.monotonic() - start
    assert elapsed < 45.0

    error = info.value
    message = str(error)
    assert set(error.failures) == {1}
    assert not error.timed_out
    assert error.unfinished == [0]
    # The full traceback, introduced by the rank number.
    assert "----- rank 1 raised during the test function -----\nTraceback (most recent call last):" in message
    assert "in _explode_on_rank_one" in message
    assert 'raise ValueError("boom from rank 1")' in message
    assert "ValueError: boom from rank 1" in message
    assert "rank 0 had not finished" in message


@pytest.mark.distributed
def test_skipped_collective_fails_within_the_timeout_naming_the_unfinished_rank() -> None:
    timeout = 12.0
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_rank_one_skips_the_all_reduce, 2, timeout=timeout)
    elapsed = time.monotonic() - start
    assert elapsed < timeout + 10.0  # kill, stack dump and join included

    error = info.value
    # Rank 1, which never joined the collective, is named as unfinished either way.
    assert 1 in error.unfinished
    assert "rank 1 had not finished" in str(error)
    if not error.timed_out:
        # The usual path: rank 0 hits gloo's collective timeout (timeout / 2) and raises
        # with a traceback through the all_reduce, before the harness timeout. (On a
        # crawling machine start-up can eat the budget and the harness timeout comes first.)
        assert set(error.failures) == {0}
        assert "in _rank_one_skips_the_all_reduce" in error.failures[0]
        assert "all_reduce" in error.failures[0]


@pytest.mark.distributed
def test_harness_timeout_kills_everything_and_shows_where_the_rank_was_stuck() -> None:
    timeout = 12.0
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_rank_zero_stuck_in_python, 2, timeout=timeout)
    elapsed = time.monotonic() - start
    assert timeout <= elapsed < timeout + 10.0

    error = info.value
    assert error.timed_out
    assert not error.failures
    assert 0 in error.unfinished
    message = str(error)
    assert "timed out after" in message
    # faulthandler's stacks of the hung ranks, taken just before the kill.
    assert (
        "----- rank 0 had not finished; killed by the harness -----\nPython stacks at the timeout:" in message
    )
    assert "in worker_main" in message
    if 1 not in error.unfinished:
        # Rank 1 returned, so both ranks got through the init rendezvous and rank 0 was in
        # its function: the stack must show where. (Normally the case; only on a crawling
        # machine can start-up outlast the timeout.)
        assert "Rank(s) [1] had returned normally" in message
        assert "_sleep_forever_here" in message


@pytest.mark.distributed
def test_rank_exiting_without_raising_is_reported_with_its_exit_code() -> None:
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_exit_three_on_rank_one, 2, timeout=60.0)
    assert time.monotonic() - start < 40.0

    error = info.value
    assert error.exit_codes == {1: 3}
    assert "rank 1 died without raising: exit code 3" in str(error)


@pytest.mark.distributed
def test_grid_all_reduces_on_two_ranks_three_cases_in_one_spawn() -> None:
    cases = [{"scale": 1.0}, {"scale": 10.0}, {"scale": 100.0}]
    results = run_distributed_cases(_scaled_all_reduce, cases, world_size=2)
    assert len(results) == 3
    for case, per_rank in zip(cases, results):
        # Every rank holds scale * (1 + 2) after the all-reduce.
        assert [value for _, value in per_rank] == [case["scale"] * 3] * 2
    # Same two processes for every case: one spawn, not three.
    pids_per_case = [tuple(pid for pid, _ in per_rank) for per_rank in results]
    assert len(set(pids_per_case)) == 1
    assert len(set(pids_per_case[0])) == 2


def _fail_on_the_second_case(rank: int, world_size: int, case: dict) -> str:
    import torch
    import torch.distributed as dist

    dist.all_reduce(torch.ones(1))
    if case["name"] == "second" and rank == 0:
        raise AssertionError(f"mismatch in {case['name']}")
    return case["name"]


@pytest.mark.distributed
def test_grid_failure_names_the_failing_case() -> None:
    cases = [{"name": "first"}, {"name": "second"}, {"name": "third"}]
    with pytest.raises(DistributedTestError) as info:
        run_distributed_cases(_fail_on_the_second_case, cases, world_size=2, timeout=60.0)
    error = info.value
    assert set(error.failures) == {0}
    assert "rank 0 raised during the test function (case 1 of 3: {'name': 'second'})" in str(error)
    assert "AssertionError: mismatch in second" in str(error)
    assert "over 3 cases" in str(error)


def _start_facts(rank: int, world_size: int) -> dict:
    import torch

    return {
        "late_env": os.environ.get("SHARDWISE_HARNESS_LATE"),
        "threads": torch.get_num_threads(),
        "parent_pid": os.getppid(),
        # imported by the forkserver, not by this module: a forked rank has it without paying for it
        "engine_preloaded": "shardwise.engine" in sys.modules,
    }


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_ranks_see_the_parents_current_environment_whatever_the_start_method(
    method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forked rank gets the parent's environment as it is at the call (not the forkserver's, which
    started earlier) and the harness's thread cap; ``spawn`` stays available and behaves the same."""
    monkeypatch.setenv("SHARDWISE_HARNESS_START", method)
    run_distributed(_start_facts, 2)  # the forkserver (if any) exists before the next variable
    monkeypatch.setenv("SHARDWISE_HARNESS_LATE", "set after the server started")
    facts = run_distributed(_start_facts, 2)
    assert [f["late_env"] for f in facts] == ["set after the server started"] * 2
    assert [f["threads"] for f in facts] == [max(1, _available_cpus() // 2)] * 2
    forked_from_server = facts[0]["parent_pid"] != os.getpid()
    assert forked_from_server == (method == "forkserver")
    assert [f["engine_preloaded"] for f in facts] == [method == "forkserver"] * 2
