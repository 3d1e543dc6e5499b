"""Acceptance: ``shardwise --autotuning tune|run`` on 2 CPU ranks and a tiny model.

One tuning (module fixture): stages [0, 1], micro batches 1-8, two kept per stage, and a memory
budget per rank between stage 1's and stage 0's plan, so stage 0 is pruned without a launch;
``run`` then trains with the best config. Then an interrupted tuning resumes: only the
experiment whose record is gone runs again. Four launches of a few seconds of training each.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launch_helpers import SCRIPTS, Result, free_port, run, shardwise_command

pytestmark = pytest.mark.integration

SCRIPT = SCRIPTS / "autotune_train.py"
NUM_PARAMS = 1_000_000  # declared in model_info: plan bytes per rank 16 MB at stage 0, 12 MB at stage 1
CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": [0, 1]},
    "autotuning": {
        "enabled": True,
        "overwrite": False,
        "start_profile_step": 1,
        "end_profile_step": 2,
        "max_train_micro_batch_size_per_gpu": 8,
        "num_tuning_micro_batch_sizes": 2,
        "model_info": {"num_params": NUM_PARAMS},
        "arg_mappings": {"train_micro_batch_size_per_gpu": "--batch_size"},
    },
}


def _tune(cwd: Path, mode: str) -> Result:
    argv = [*shardwise_command(), "--num_gpus", "2", "--master_port", str(free_port()), "--autotuning", mode,
            "--autotuning_memory_per_rank", "14000000", str(SCRIPT), "--deepspeed_config", "ds.json",
            "--record", "record.txt"]  # fmt: skip
    return run(argv, cwd, timeout=900.0)


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Result]:
    cwd = tmp_path_factory.mktemp("autotune")
    (cwd / "ds.json").write_text(json.dumps(CONFIG))
    return cwd, _tune(cwd, "run")


def test_tuning_explores_the_space_the_plan_allows_and_run_trains_the_best(
    tuned: tuple[Path, Result],
) -> None:
    cwd, result = tuned
    assert result.returncode == 0, result.stderr[-4000:]
    results = cwd / "autotuning_results"
    summary = json.loads((results / "summary.json").read_text())
    assert summary["counts"] == {"pruned": 4, "ok": 2}, summary
    statuses = {
        p.name: json.loads((p / "result.json").read_text())["status"] for p in results.iterdir() if p.is_dir()
    }
    assert statuses == {
        **{f"z0_mbs{m}_gas1": "pruned" for m in (1, 2, 4, 8)},
        "z1_mbs1_gas1": "ok",
        "z1_mbs8_gas1": "ok",
    }
    assert sorted(p.name for p in (cwd / "autotuning_exps").iterdir()) == [
        "z1_mbs1_gas1.json",
        "z1_mbs8_gas1.json",
    ]
    pruned = json.loads((results / "z0_mbs1_gas1" / "result.json").read_text())
    assert pruned["predicted_bytes"] == 16 * NUM_PARAMS
    assert pruned["error"] == "the plan needs 15.3 MiB per rank, 13.4 MiB available"
    best = json.loads((results / "ds_config_optimal.json").read_text())
    assert summary["best"] in ("z1_mbs1_gas1", "z1_mbs8_gas1") and "autotuning" not in best
    micro = best["train_micro_batch_size_per_gpu"]
    assert best["zero_optimization"] == {"stage": 1} and best["train_batch_size"] == 2 * micro
    # each experiment got its micro batch through arg_mappings and ended itself; run trained the best
    lines = (cwd / "record.txt").read_text().splitlines()
    assert lines.count("batch_size 1 micro 1") == 1 and lines[-2:] == [
        f"batch_size {micro} micro {micro}",
        f"trained 1 {micro}",
    ]
    assert "z1_mbs8_gas1  ok" in result.stderr


def test_an_interrupted_tuning_resumes_with_the_missing_experiment_only(tuned: tuple[Path, Result]) -> None:
    cwd, first = tuned
    assert first.returncode == 0
    results = cwd / "autotuning_results"
    kept = results / "z1_mbs8_gas1" / "result.json"
    before = kept.read_text()
    (results / "z1_mbs1_gas1" / "result.json").unlink()  # as if the tuning died during this experiment
    again = _tune(cwd, "tune")
    assert again.returncode == 0, again.stderr[-4000:]
    assert "z1_mbs8_gas1 already ran (ok), kept (overwrite: false)" in again.stderr
    assert "z1_mbs1_gas1 already ran" not in again.stderr
    assert json.loads((results / "z1_mbs1_gas1" / "result.json").read_text())["status"] == "ok"
    assert kept.read_text() == before
    assert (cwd / "record.txt").read_text().count("trained") == 1  # tune does not train
