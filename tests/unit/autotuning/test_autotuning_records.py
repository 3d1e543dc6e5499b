"""Experiment records on disk, the memory prediction, and the report."""

from __future__ import annotations

import json
from pathlib import Path

from shardwise.autotuning.memory_fit import ModelInfo, predicted_bytes
from shardwise.autotuning.records import ExperimentStore, Record
from shardwise.autotuning.report import BEST_CONFIG, summary_table, write_best


def test_only_finished_experiments_are_resumed(tmp_path: Path) -> None:
    store = ExperimentStore(str(tmp_path / "exps"), str(tmp_path / "results"))
    path = store.describe("z1_mbs2_gas1", {"stage": 1}, {"train_batch_size": 4})
    assert json.loads(Path(path).read_text()) == {"train_batch_size": 4}
    assert json.loads((tmp_path / "exps" / "z1_mbs2_gas1.json").read_text())["settings"] == {"stage": 1}
    assert store.finished("z1_mbs2_gas1") is None  # described, never ran
    store.save(Record("z1_mbs2_gas1", "failed", error="exit 1"))
    store.save(Record("z3_mbs64_gas1", "pruned"))
    assert store.finished("z1_mbs2_gas1").error == "exit 1"
    assert store.finished("z3_mbs64_gas1") is None  # pruning is decided again each time
    (tmp_path / "results" / "z1_mbs2_gas1" / "result.json").write_text("{torn")
    assert store.finished("z1_mbs2_gas1") is None


def test_prediction_is_the_plan_plus_activations() -> None:
    info = ModelInfo(num_params=1000, activation_mem_per_sample=10.0)
    base = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1}
    stage0 = predicted_bytes({**base, "train_batch_size": 8}, info, 2, on_gpu=False)
    stage2 = predicted_bytes(
        {**base, "train_batch_size": 8, "zero_optimization": {"stage": 2}}, info, 2, on_gpu=False
    )
    assert stage0 == 16 * 1000 + 40  # fp32 params, grads, Adam moments
    assert stage2 == 4 * 1000 + 4 * 500 + 8 * 500 + 40  # grads and moments sharded on 2 ranks
    offloaded = {
        **base,
        "train_batch_size": 8,
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    }
    # offload frees the GPU; on CPU ranks the host holds it all, so it never helps there
    assert (
        predicted_bytes(offloaded, info, 2, on_gpu=True)
        < stage2
        <= predicted_bytes(offloaded, info, 2, on_gpu=False)
    )


def test_best_config_and_summary(tmp_path: Path) -> None:
    records = [
        Record("a", "ok", metric=2.0),
        Record("b", "ok", metric=3.0),
        Record("c", "pruned", error="too big"),
    ]
    path = write_best(
        str(tmp_path), records[1], {"train_batch_size": 2, "autotuning": {"enabled": True}}, records, {}
    )
    assert path == str(tmp_path / BEST_CONFIG)
    assert json.loads(Path(path).read_text()) == {"train_batch_size": 2}
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["best"], summary["ran"], summary["pruned"]) == ("b", 2, 1)
    assert summary_table(records, "throughput", "b").splitlines()[2].endswith("3.00  best")
