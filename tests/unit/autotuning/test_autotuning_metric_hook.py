"""The experiment-side step hook: the metric window, the metrics file, the model profile."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from shardwise.autotuning.metric_hook import build_autotuning_hook
from shardwise.config import load_config
from shardwise.runtime.step_hooks import StepOutcome


def _config(block: dict, micro: int = 2):
    return load_config({"train_micro_batch_size_per_gpu": micro, "autotuning": block}).config


def test_metric_mode_measures_between_start_and_end_then_exits(tmp_path: Path) -> None:
    path = tmp_path / "m" / "metrics.json"
    block = {"enabled": True, "metric_path": str(path), "start_profile_step": 2, "end_profile_step": 4}
    hook = build_autotuning_hook(_config(block).autotuning, torch.nn.Linear(2, 2), rank=0, micro_batch=2)
    assert hook is not None
    exits: list[int] = []
    hook.exit_run = lambda: exits.append(1)
    for step in (1, 2, 3):
        hook.after_optimizer_step(StepOutcome(step, 8 * step, True, 1.0))
    assert not path.exists() and not exits
    hook.after_optimizer_step(StepOutcome(4, 32, True, 1.0))
    metrics = json.loads(path.read_text())
    assert exits == [1] and metrics["steps"] == 2
    assert metrics["throughput"] == 16 / metrics["seconds"]
    assert metrics["latency"] == 1000 * metrics["seconds"] / 2 and metrics["FLOPS_per_gpu"] is None


def test_other_ranks_exit_without_writing_and_flops_are_counted(tmp_path: Path) -> None:
    path = tmp_path / "metrics.json"
    block = {
        "enabled": True,
        "metric_path": str(path),
        "metric": "flops",
        "start_profile_step": 0,
        "end_profile_step": 1,
    }
    model = torch.nn.Linear(4, 3)
    for rank in (1, 0):
        hook = build_autotuning_hook(_config(block).autotuning, model, rank=rank, micro_batch=2)
        assert hook is not None
        hook.exit_run = lambda: None
        hook.after_optimizer_step(StepOutcome(0, 0, True, 1.0))
        model(torch.randn(5, 4))
        hook.after_optimizer_step(StepOutcome(1, 10, True, 1.0))
        assert path.exists() == (rank == 0)
    metrics = json.loads(path.read_text())
    assert metrics["FLOPS_per_gpu"] == 3 * 2 * 5 * 4 * 3 / metrics["seconds"]  # 3 x (2 x batch x in x out)


def test_profile_mode_counts_parameters_and_saved_activations(tmp_path: Path) -> None:
    path = tmp_path / "info.json"
    block = {"enabled": True, "model_info": {"profile": True}, "model_info_path": str(path)}
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh())
    hook = build_autotuning_hook(_config(block, micro=2).autotuning, model, rank=0, micro_batch=2)
    assert hook is not None
    hook.exit_run = lambda: None
    model(torch.randn(2, 8)).sum().backward()
    model(torch.randn(2, 8))  # later forwards are not counted
    hook.after_optimizer_step(StepOutcome(1, 4, True, 1.0))
    info = json.loads(path.read_text())
    # saved for backward: the input (2 x 8 fp32) and tanh's output (2 x 16 fp32); the weight is a parameter
    assert info == {
        "num_params": 8 * 16 + 16,
        "trainable_num_params": 8 * 16 + 16,
        "activation_mem_per_gpu": (16 + 32) * 4,
        "activation_mem_per_sample": (16 + 32) * 4 / 2,
        "micro_batch": 2,
    }


def test_no_hook_without_a_destination() -> None:
    assert (
        build_autotuning_hook(
            _config({"enabled": True}).autotuning, torch.nn.Linear(2, 2), rank=0, micro_batch=2
        )
        is None
    )
    assert (
        build_autotuning_hook(
            _config({"metric_path": "x"}).autotuning, torch.nn.Linear(2, 2), rank=0, micro_batch=2
        )
        is None
    )
