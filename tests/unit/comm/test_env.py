"""Launcher discovery, SLURM list parsing, timeouts, and the algorithm table: pure, no process group."""

from __future__ import annotations

import re
import subprocess
import sys
from datetime import timedelta

import pytest

from shardwise.comm.env import (
    DistEnv,
    discover_environment,
    expand_nodelist,
    parse_tasks_per_node,
    timeout_from_env,
)

TORCHRUN = {
    "RANK": "3",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "10.0.0.5",
    "MASTER_PORT": "29511",
}
OPENMPI = {
    "OMPI_COMM_WORLD_RANK": "5",
    "OMPI_COMM_WORLD_SIZE": "8",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
}
MPICH = {"PMI_RANK": "6", "PMI_SIZE": "8", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "4"}
SLURM_TASK = {
    "SLURM_PROCID": "7",
    "SLURM_NTASKS": "8",
    "SLURM_STEP_NUM_TASKS": "8",
    "SLURM_LOCALID": "3",
    "SLURM_NODEID": "1",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
    "SLURM_STEP_NODELIST": "gpu[07-08]",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_LAUNCH_NODE_IPADDR": "10.9.9.9",
}


# --------------------------------------------------------------------------------------
# Each launcher on its own.
# --------------------------------------------------------------------------------------


def test_torchrun_variables() -> None:
    assert discover_environment(TORCHRUN) == DistEnv(
        rank=3,
        world_size=8,
        local_rank=1,
        local_world_size=2,
        master_addr="10.0.0.5",
        master_port=29511,
        launcher="torchrun",
    )


def test_torchrun_local_size_alias_and_unknown_local_size() -> None:
    env = {k: v for k, v in TORCHRUN.items() if k != "LOCAL_WORLD_SIZE"}
    assert discover_environment(env).local_world_size is None  # type: ignore[union-attr]
    assert discover_environment({**env, "LOCAL_SIZE": "2"}).local_world_size == 2  # type: ignore[union-attr]


def test_openmpi_with_master_vars() -> None:
    d = discover_environment({**OPENMPI, "MASTER_ADDR": "node1", "MASTER_PORT": "1234"})
    assert d == DistEnv(5, 8, 1, 4, "node1", 1234, "openmpi")


def test_mpich_and_intel_mpi() -> None:
    d = discover_environment({**MPICH, "MASTER_ADDR": "node1"}, default_port=29500)
    assert d == DistEnv(6, 8, 2, 4, "node1", 29500, "mpich")


def test_slurm_srun_task_uses_first_host_of_step_nodelist() -> None:
    d = discover_environment(SLURM_TASK, default_port=29500)
    assert d == DistEnv(7, 8, 3, 4, "gpu07", 29500, "slurm")


def test_slurm_tasks_per_node_from_node_index_and_fallbacks() -> None:
    env = {**SLURM_TASK, "SLURM_STEP_TASKS_PER_NODE": "3,5", "SLURM_LOCALID": "4"}
    assert discover_environment(env, default_port=1).local_world_size == 5  # type: ignore[union-attr]
    env = {k: v for k, v in SLURM_TASK.items() if k != "SLURM_STEP_TASKS_PER_NODE"}
    env["SLURM_NTASKS_PER_NODE"] = "4"
    assert discover_environment(env, default_port=1).local_world_size == 4  # type: ignore[union-attr]


def test_slurm_master_falls_back_to_job_nodelist_then_launch_node() -> None:
    env = {k: v for k, v in SLURM_TASK.items() if k != "SLURM_STEP_NODELIST"}
    env["SLURM_JOB_NODELIST"] = "a1,b[2-3]"
    assert discover_environment(env, default_port=1).master_addr == "a1"  # type: ignore[union-attr]
    env = {k: v for k, v in env.items() if k != "SLURM_JOB_NODELIST"}
    assert discover_environment(env, default_port=1).master_addr == "10.9.9.9"  # type: ignore[union-attr]


def test_slurm_batch_script_is_not_a_task() -> None:
    # The batch script has SLURM_PROCID=0 and SLURM_NTASKS=N but no step id: reading it as
    # rank 0 of N would wait forever for N-1 ranks nobody started.
    batch = {"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_LOCALID": "0", "SLURM_JOB_NODELIST": "n[1-2]"}
    assert discover_environment(batch) is None
    assert discover_environment({**batch, "SLURM_STEP_ID": "batch"}) is None
    assert discover_environment({**batch, "SLURM_STEP_ID": "4294967294"}) is None


def test_no_launcher_means_single_process() -> None:
    assert discover_environment({}) is None
    assert discover_environment({"PATH": "/usr/bin", "HOME": "/root"}) is None


def test_torch_env_round_trips() -> None:
    d = discover_environment(TORCHRUN)
    assert d is not None
    assert d.torch_env() == TORCHRUN
    assert discover_environment(d.torch_env()) == d


# --------------------------------------------------------------------------------------
# Precedence and the MASTER_* rules.
# --------------------------------------------------------------------------------------


def test_precedence_torchrun_over_mpi_over_slurm() -> None:
    everything = {**SLURM_TASK, **MPICH, **OPENMPI, **TORCHRUN}
    assert discover_environment(everything).launcher == "torchrun"  # type: ignore[union-attr]
    no_torchrun = {k: v for k, v in everything.items() if k not in TORCHRUN}
    d = discover_environment({**no_torchrun, "MASTER_ADDR": "x"}, default_port=1)
    assert (d.launcher, d.rank) == ("openmpi", 5)  # type: ignore[union-attr]
    mpich_slurm = {**SLURM_TASK, **MPICH, "MASTER_ADDR": "x"}
    assert discover_environment(mpich_slurm, default_port=1).launcher == "mpich"  # type: ignore[union-attr]


def test_auto_mpi_discovery_off_reads_only_torchrun() -> None:
    assert discover_environment({**OPENMPI, **SLURM_TASK}, default_port=1, auto_mpi_discovery=False) is None
    d = discover_environment({**OPENMPI, **TORCHRUN}, auto_mpi_discovery=False)
    assert d.launcher == "torchrun"  # type: ignore[union-attr]


def test_master_addr_env_overrides_slurm_nodelist() -> None:
    d = discover_environment({**SLURM_TASK, "MASTER_ADDR": "10.1.1.1", "MASTER_PORT": "4000"})
    assert (d.master_addr, d.master_port) == ("10.1.1.1", 4000)  # type: ignore[union-attr]


def test_single_node_jobs_default_master_to_loopback() -> None:
    one_node = {**OPENMPI, "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4"}
    assert discover_environment(one_node, default_port=29500).master_addr == "127.0.0.1"  # type: ignore[union-attr]
    assert (
        discover_environment({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "7"}).master_addr == "127.0.0.1"
    )  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("env", "kwargs", "needle"),
    [
        (OPENMPI, {"default_port": 29500}, "MASTER_ADDR"),  # multi-node MPI: nobody knows rank 0's host
        ({**OPENMPI, "MASTER_ADDR": "h"}, {}, "MASTER_PORT"),  # no port and no default
        ({**TORCHRUN, "MASTER_PORT": "abc"}, {}, "MASTER_PORT='abc'"),
        ({**TORCHRUN, "MASTER_PORT": "70000"}, {}, "1-65535"),
        ({k: v for k, v in TORCHRUN.items() if k != "LOCAL_RANK"}, {}, "LOCAL_RANK"),
        ({"RANK": "0"}, {}, "WORLD_SIZE is not"),
        ({"WORLD_SIZE": "2"}, {}, "RANK is not"),
        ({**TORCHRUN, "RANK": "8"}, {}, "below the world size"),
        ({**TORCHRUN, "WORLD_SIZE": "0"}, {}, "WORLD_SIZE='0' must be >= 1"),
        ({**TORCHRUN, "LOCAL_RANK": "2"}, {}, "local rank 2 of 2"),
        ({**TORCHRUN, "LOCAL_WORLD_SIZE": "9"}, {}, "cannot exceed"),
        ({**MPICH, "MASTER_ADDR": "h", "MPI_LOCALRANKID": ""}, {"default_port": 1}, "MPI_LOCALRANKID"),
        ({k: v for k, v in SLURM_TASK.items() if k != "SLURM_LOCALID"}, {"default_port": 1}, "SLURM_LOCALID"),
    ],
)
def test_errors_name_the_variable(env: dict[str, str], kwargs: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=re.escape(needle)):
        discover_environment(env, **kwargs)


def test_require_master_false_leaves_rendezvous_unknown() -> None:
    d = discover_environment(OPENMPI, require_master=False)
    assert d is not None
    assert (d.master_addr, d.master_port) == ("", 0)
    assert "MASTER_ADDR" not in d.torch_env() and "MASTER_PORT" not in d.torch_env()


# --------------------------------------------------------------------------------------
# SLURM's compressed lists.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
        ("a1,b[2-3]", ["a1", "b2", "b3"]),
        ("single", ["single"]),
        ("gpu[8-11]", ["gpu8", "gpu9", "gpu10", "gpu11"]),
        ("gpu[008-010]", ["gpu008", "gpu009", "gpu010"]),
        ("r[1-2]-n[1-2]", ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]),
        ("x[3],y[1,4-5],z", ["x3", "y1", "y4", "y5", "z"]),
    ],
)
def test_expand_nodelist(nodelist: str, hosts: list[str]) -> None:
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["", "node[01-03", "node01-03]", "node[3-1]", "node[a-b]", "n[1,,2]"])
def test_expand_nodelist_rejects_malformed(bad: str) -> None:
    with pytest.raises(ValueError, match="node list"):
        expand_nodelist(bad)


def test_parse_tasks_per_node() -> None:
    assert parse_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert parse_tasks_per_node("4") == [4]
    with pytest.raises(ValueError, match="tasks-per-node"):
        parse_tasks_per_node("2(3)")


# --------------------------------------------------------------------------------------
# Timeouts.
# --------------------------------------------------------------------------------------


def test_timeout_sources_and_precedence() -> None:
    assert timeout_from_env({}) == timedelta(minutes=10)
    assert timeout_from_env({"DEEPSPEED_TIMEOUT": "30"}) == timedelta(minutes=30)
    assert timeout_from_env({"DEEPSPEED_TIMEOUT": "30", "SHARDWISE_TIMEOUT": "2"}) == timedelta(minutes=2)
    both = {"SHARDWISE_TIMEOUT": "2", "SHARDWISE_TIMEOUT_SECONDS": "7.5"}
    assert timeout_from_env(both) == timedelta(seconds=7.5)


@pytest.mark.parametrize("value", ["abc", "0", "-3", "inf", "nan"])
def test_timeout_rejects_bad_values(value: str) -> None:
    with pytest.raises(ValueError, match="DEEPSPEED_TIMEOUT"):
        timeout_from_env({"DEEPSPEED_TIMEOUT": value})


# --------------------------------------------------------------------------------------
# Package hygiene and the algorithm table.
# --------------------------------------------------------------------------------------


def test_env_discovery_does_not_import_torch() -> None:
    code = (
        "import sys; import shardwise.comm.env as e; import shardwise.comm as c; "
        "assert c.discover_environment is e.discover_environment; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_choose_algorithm_follows_the_measurements() -> None:
    from shardwise.comm.collectives import GLOO_ALL_GATHER_VIA_ALL_REDUCE_MIN_BYTES as cliff
    from shardwise.comm.collectives import choose_algorithm

    assert cliff == 32 * 2**20
    # gloo all-gather: native below the 32 MiB cliff, all-reduce from it on (any dtype: bytes count).
    assert choose_algorithm("all_gather", "gloo", "cpu", cliff - 1) == "native"
    assert choose_algorithm("all_gather", "gloo", "cpu", cliff) == "all_reduce"
    # gloo reduce-scatter: all-reduce in place when the input may be clobbered, else native.
    for nbytes in (1024, cliff, 4 * cliff):
        assert (
            choose_algorithm("reduce_scatter", "gloo", "cpu", nbytes, input_is_scratch=True) == "all_reduce"
        )
        assert choose_algorithm("reduce_scatter", "gloo", "cpu", nbytes) == "native"
    # nccl / GPU tensors: always native.
    for collective in ("reduce_scatter", "all_gather"):
        assert choose_algorithm(collective, "nccl", "cuda", 4 * cliff, input_is_scratch=True) == "native"  # type: ignore[arg-type]
        assert choose_algorithm(collective, "cpu:gloo,cuda:nccl", "cuda", 4 * cliff) == "native"  # type: ignore[arg-type]
    assert choose_algorithm("all_gather", "cpu:gloo,cuda:nccl", "cpu", cliff) == "all_reduce"
    # gloo groups of two ranks on CPU: the point-to-point exchange, at every size and either input
    # kind (measured there); other group sizes keep the rules above, and other backends native
    for nbytes in (1024, cliff, 4 * cliff):
        for collective in ("reduce_scatter", "all_gather"):
            for scratch in (False, True):
                assert choose_algorithm(collective, "gloo", "cpu", nbytes, input_is_scratch=scratch,  # type: ignore[arg-type]
                                        world_size=2) == "exchange"  # fmt: skip
            assert choose_algorithm(collective, "nccl", "cuda", nbytes, world_size=2) == "native"  # type: ignore[arg-type]
    assert (
        choose_algorithm("reduce_scatter", "gloo", "cpu", 1024, input_is_scratch=True, world_size=3)
        == "all_reduce"
    )
    assert choose_algorithm("all_gather", "gloo", "cpu", cliff, world_size=4) == "all_reduce"
    with pytest.raises(ValueError, match="unknown collective"):
        choose_algorithm("all_to_all", "gloo", "cpu", 1)  # type: ignore[arg-type]
