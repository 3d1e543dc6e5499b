"""The launch contract seen by a script: DeepSpeed's variables and ``--local_rank``, env files,
the elastic c10d path with the batch size for the current world size, and the same script
under plain torchrun."""

from __future__ import annotations

import json
import sys

import pytest
from launch_helpers import DIST_MODES, free_port, run, shardwise_command

from shardwise.elasticity import elastic_batch_for_world_size

pytestmark = pytest.mark.integration

ELASTIC = {
    "elasticity": {"enabled": True, "max_train_batch_size": 16, "micro_batch_sizes": [2, 4], "min_gpus": 1,
                   "max_gpus": 4, "version": 0.1},
    "optimizer": {"type": "Adam", "params": {"lr": 0.001}},
}  # fmt: skip


def env_lines(stdout: str) -> list[dict]:
    return sorted((json.loads(line[4:]) for line in stdout.splitlines() if line.startswith("ENV ")),
                  key=lambda d: int(d["RANK"]))  # fmt: skip


def test_elastic_two_local_nodes_get_the_contract_env_files_and_elastic_batch(tmp_path) -> None:
    (tmp_path / "ds.json").write_text(json.dumps(ELASTIC))
    (tmp_path / ".shardwise_env").write_text("# exported on every node\nSW_TEST_FROM_ENV_FILE=hello=world\n")
    result = run(
        [*shardwise_command(), "--launcher", "local", "--num_nodes", "2", "--num_gpus", "1", "--elastic_training",
         "--master_port", str(free_port()), str(DIST_MODES), "env", "--deepspeed_config", "ds.json"],
        tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    assert "--rdzv-backend=c10d" in result.stderr and "--nnodes=1:2" in result.stderr
    ranks = env_lines(result.stdout)
    assert [r["RANK"] for r in ranks] == ["0", "1"]
    assert sorted(r["CROSS_RANK"] for r in ranks) == ["0", "1"]  # one process on each node
    expected_batch = list(elastic_batch_for_world_size(ELASTIC, 2))
    for info in ranks:
        assert info["WORLD_SIZE"] == "2" and info["LOCAL_SIZE"] == "1" and info["CROSS_SIZE"] == "2"
        assert info["LOCAL_RANK"] == "0" and info["local_rank_arg"] == 0
        assert info["MASTER_ADDR"] and info["MASTER_PORT"]
        assert info["SW_TEST_FROM_ENV_FILE"] == "hello=world"
        assert info["allreduce"] == 3.0
        assert info["batch"] == expected_batch


def _plain_torchrun(tmp_path, mode: str):
    """``torchrun --nproc-per-node 2 dist_modes.py MODE``; it must succeed."""
    result = run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
         str(DIST_MODES), mode],
        tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def test_the_same_script_runs_under_plain_torchrun(tmp_path) -> None:
    result = _plain_torchrun(tmp_path, "env")
    ranks = env_lines(result.stdout)
    assert [(r["RANK"], r["LOCAL_RANK"], r["local_rank_arg"], r["allreduce"]) for r in ranks] == [
        ("0", "0", None, 3.0),
        ("1", "1", None, 3.0),
    ]


def test_no_shardwise_thread_outlives_the_exit_handlers(tmp_path) -> None:
    """A daemon thread blocked in a store call while Python finalizes can abort the process
    (exit -6 after a clean run) when the store's host rank exits first: shardwise's exit
    handler stops its diagnostics thread, even when the script destroyed the group itself."""
    result = _plain_torchrun(tmp_path, "exit")
    reports = sorted(
        (json.loads(line[len("EXIT ") :]) for line in result.stdout.splitlines() if line.startswith("EXIT ")),
        key=lambda r: r["rank"],
    )
    assert reports == [{"rank": "0", "alive": []}, {"rank": "1", "alive": []}]
