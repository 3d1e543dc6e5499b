"""Launching one experiment: the command line, arg_mappings, and how a launch ended."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from shardwise.autotuning.runner import ExperimentLaunch, apply_arg_mappings, replace_config_arg, run_launch


def test_config_argument_is_replaced_or_added() -> None:
    assert replace_config_arg(["--deepspeed_config=a.json"], "b.json") == ["--deepspeed_config=b.json"]
    assert replace_config_arg(["--lr", "1"], "b.json") == ["--lr", "1", "--deepspeed_config", "b.json"]


def test_arg_mappings_set_replace_or_append_and_reject_unknown_keys() -> None:
    config = {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 2}}
    mappings = {"train_micro_batch_size_per_gpu": "--bs", "zero_optimization.stage": "--zero"}
    assert apply_arg_mappings(["--bs=1", "--x"], mappings, config) == ["--bs=8", "--x", "--zero", "2"]
    with pytest.raises(ValueError, match=r"'gradient_accumulation_steps' .* is not a key"):
        apply_arg_mappings([], {"gradient_accumulation_steps": "--gas"}, config)


def test_command_runs_our_launcher_with_the_experiment_config() -> None:
    launch = ExperimentLaunch(
        ("--num_gpus", "2"), "train.py", ("--deepspeed_config", "ds.json"), {"a": "--a"}
    )
    assert launch.command("exp.json", {"a": 3})[1:] == [
        "-m", "shardwise.launcher", "--num_gpus", "2", "train.py", "--deepspeed_config", "exp.json", "--a", "3"
    ]  # fmt: skip


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


@pytest.mark.parametrize(
    ("code", "status", "error"),
    [
        ("open(sys.argv[1], 'w').write('{}')", "ok", ""),
        ("raise SystemExit(3)", "failed", "exit 3"),
        ("raise MemoryError('CUDA out of memory')", "oom", "out of memory"),
        ("pass", "failed", "stopped before autotuning.end_profile_step"),
    ],
)
def test_how_a_launch_ended(tmp_path: Path, code: str, status: str, error: str) -> None:
    expect = tmp_path / "metrics.json"
    outcome = run_launch([*_python("import sys\n" + code), str(expect)], str(tmp_path), 60, str(expect))
    assert outcome.status == status and error in outcome.error
    assert (tmp_path / "stdout.log").exists() and (tmp_path / "stderr.log").exists()


def test_a_launch_past_its_timeout_is_stopped(tmp_path: Path) -> None:
    outcome = run_launch(_python("import time; time.sleep(60)"), str(tmp_path), 1.0, str(tmp_path / "m.json"))
    assert outcome.status == "timeout" and outcome.seconds < 30
