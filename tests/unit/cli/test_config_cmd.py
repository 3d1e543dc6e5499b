"""``shardwise config check|explain``, run in-process through ``shardwise.cli.main.main``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shardwise.cli.main import main
from shardwise.config.auto import LITERAL_AUTO_FIELDS
from shardwise.utils.logging import get_logger

GOOD = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": 2,
    "bfloat16": {"enabled": True},
    "zero_optimization": {"stage": 2, "cpu_offload": True, "reduce_bucket_size": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto", "warmup_num_steps": 10}},
}


@pytest.fixture(autouse=True)
def _keep_log_level() -> Iterator[None]:
    # the CLI lowers the library logger to ERROR for its own output; undo that for other tests
    logger = get_logger()
    level = logger.level
    yield
    logger.setLevel(level)


def _write(tmp_path: Path, data: dict[str, Any] | str, name: str = "ds.json") -> str:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data), encoding="utf-8")
    return str(path)


def _autos(tree: Any, prefix: str = "") -> list[str]:
    if isinstance(tree, dict):
        out = []
        for key, value in tree.items():
            path = f"{prefix}{key}"
            if isinstance(value, str) and value.lower() == "auto":
                out.append(path)
            out.extend(_autos(value, path + "."))
        return out
    if isinstance(tree, list):
        return [p for i, v in enumerate(tree) for p in _autos(v, f"{prefix}{i}.")]
    return []


def test_check_good_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(
        tmp_path, {"train_batch_size": 16, "zero_optimization": {"stage": 1}, "fp16": {"enabled": True}}
    )
    assert main(["config", "check", path, "--world-size", "4"]) == 0
    out = capsys.readouterr().out
    assert f"OK   {path}: batch 16 = 4 x 1 x 4, ZeRO 1, fp16" in out
    assert "warning" not in out


def test_check_bad_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, {"train_batch_size": 30, "zero_optimization": {"stage": 5}})
    assert main(["config", "check", path, "--world-size", "4"]) == 1
    err = capsys.readouterr().err
    assert f"FAIL {path}" in err
    assert "'train_batch_size' = 30" in err and "30 != 7 x 1 x 4" in err
    assert "'zero_optimization.stage' = 5" in err
    assert "fix:" in err


def test_check_several_files_fails_if_any_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = _write(tmp_path, {"train_batch_size": 4}, "good.json")
    bad = _write(tmp_path, "{not json", "bad.json")
    assert main(["config", "check", good, bad]) == 1
    captured = capsys.readouterr()
    assert f"OK   {good}" in captured.out and f"FAIL {bad}" in captured.err
    assert "not valid JSON or hjson" in captured.err


def test_check_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = str(tmp_path / "nope.json")
    assert main(["config", "check", missing]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_check_prints_warnings(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, {"train_batch_size": 4, "gradient_accumulation": 2})
    assert main(["config", "check", path]) == 0
    out = capsys.readouterr().out
    assert "(1 warning(s))" in out
    assert "warning: unknown top-level key 'gradient_accumulation' ignored" in out


def test_strict_turns_unknown_keys_into_failures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    top = _write(tmp_path, {"train_batch_size": 4, "gradient_accumulation": 2}, "top.json")
    lenient = _write(tmp_path, {"train_batch_size": 4, "pipeline": {"stagez": 2}}, "lenient.json")
    assert main(["config", "check", top, lenient]) == 0
    capsys.readouterr()
    assert main(["config", "check", "--strict", top]) == 1
    err = capsys.readouterr().err
    assert (
        "unknown top-level key (strict mode)" in err and "did you mean 'gradient_accumulation_steps'?" in err
    )
    assert main(["config", "check", "--strict", lenient]) == 1
    assert "'pipeline.stagez'" in capsys.readouterr().err


def test_world_size_changes_the_batch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3})
    assert main(["config", "check", path]) == 0
    assert "batch 6 = 2 x 3 x 1" in capsys.readouterr().out
    assert main(["config", "check", path, "--world-size", "8"]) == 0
    assert "batch 48 = 2 x 3 x 8" in capsys.readouterr().out


def test_world_size_can_make_a_file_fail(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4})
    assert main(["config", "check", path, "--world-size", "4"]) == 0
    assert main(["config", "check", path, "--world-size", "3"]) == 1
    assert "32 != 4 x 2 x 3" in capsys.readouterr().err


def test_set_fills_auto_and_parses_json_values(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(
        tmp_path, {"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": "auto"}}
    )
    argv = [
        "config",
        "check",
        path,
        "--world-size",
        "2",
        "--set",
        "train_micro_batch_size_per_gpu=4",
        "--set",
        "zero_optimization.stage=3",
        "--set",
        "optimizer.type=AdamW",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "batch 8 = 4 x 1 x 2, ZeRO 3" in out
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["optimizer"]["type"] == "AdamW"  # not JSON, so kept as text
    assert data["zero_optimization"]["stage"] == 3


def test_set_conflicting_with_file_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, {"train_batch_size": 8, "zero_optimization": {"stage": 2}})
    assert main(["config", "check", path, "--set", "zero_optimization.stage=3"]) == 1
    assert "the caller's override says 3" in capsys.readouterr().err


def test_set_without_equals_sign_exits(tmp_path: Path) -> None:
    path = _write(tmp_path, {"train_batch_size": 8})
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        main(["config", "check", path, "--set", "gradient_clipping"])


def test_explain_shows_every_source_and_the_notes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, GOOD)
    argv = ["config", "explain", path, "--world-size", "2", "--set", "train_micro_batch_size_per_gpu=4"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"config: {path}  (world size 2)")
    assert (
        "batch: train_batch_size=16 = micro 4 x accumulation 2 x world 2; ZeRO stage 2; precision bf16" in out
    )
    headings = [
        "Set by the caller (overrides) (1):",
        "From the file (",
        'Resolved from "auto" (2):',
        "Derived from other values (2):",
        "Defaults (not in the file) (",
    ]
    positions = [out.index(h) for h in headings]
    assert positions == sorted(positions)
    assert '<- replaced "auto"' in out
    assert "<- legacy spelling 'zero_optimization.cpu_offload'" in out
    assert "<- AdamW default" in out and "[0.9, 0.999]" in out
    assert "<- section default 500000000" in out
    assert "<- the optimizer's lr" in out
    assert "<- micro x accumulation x world (world size 2)" in out
    assert "zero_optimization.offload_optimizer.device" in out
    assert "Warnings:" in out and "cpu_offload' is deprecated" in out


def test_explain_no_defaults_hides_defaults(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, {"train_batch_size": 8, "gradient_accumulation": 1})
    assert main(["config", "explain", path, "--no-defaults"]) == 0
    out = capsys.readouterr().out
    assert "Defaults (not in the file)" not in out
    assert "aio.block_size" not in out
    assert "From the file (1):" in out and "Derived from other values (2):" in out
    assert "Ignored top-level keys (not DeepSpeed settings): gradient_accumulation" in out


def test_explain_default_shows_defaults(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, {"train_batch_size": 8})
    assert main(["config", "explain", path]) == 0
    out = capsys.readouterr().out
    assert "Defaults (not in the file) (" in out
    assert "aio.block_size" in out and "1_048_576" in out  # big ints are grouped for reading
    assert "zero_optimization.reduce_bucket_size" in out and "500_000_000" in out


def test_explain_bad_file_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, {"train_batch_size": 8, "bf16": {"check_overflow": True}})
    assert main(["config", "explain", path]) == 1
    assert "did you mean 'check_grad_overflow'?" in capsys.readouterr().err


def test_json_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, GOOD)
    assert (
        main(
            [
                "config",
                "explain",
                path,
                "--json",
                "--world-size",
                "2",
                "--set",
                "train_micro_batch_size_per_gpu=4",
            ]
        )
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert (
        data["train_batch_size"],
        data["train_micro_batch_size_per_gpu"],
        data["gradient_accumulation_steps"],
    ) == (16, 4, 2)
    # DeepSpeed's key names, legacy spellings rewritten
    assert data["bf16"]["enabled"] is True and "bfloat16" not in data
    assert data["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert "cpu_offload" not in data["zero_optimization"]
    assert data["zero_optimization"]["stage3_prefetch_bucket_size"] == 50_000_000
    assert data["optimizer"] == {
        "type": "AdamW",
        "params": {"lr": 3e-4, "betas": [0.9, 0.999]},
        "legacy_fusion": False,
    }
    assert data["scheduler"]["params"] == {"warmup_max_lr": 3e-4, "warmup_num_steps": 10}
    assert data["gradient_clipping"] == 1.0
    # nothing left to resolve; the two fields where "auto" is a real value are the exception
    assert set(_autos(data)) <= LITERAL_AUTO_FIELDS


def test_json_output_from_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(
        tmp_path, {"train_batch_size": "auto", "gradient_clipping": "auto", "bf16": {"enabled": "auto"}}
    )
    assert main(["config", "check", path, "--json", "--world-size", "2"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["train_batch_size"], data["gradient_clipping"], data["bf16"]["enabled"]) == (2, 1.0, False)
    assert set(_autos(data)) <= LITERAL_AUTO_FIELDS


def test_hjson_file_through_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(
        tmp_path, '{\n  // comment\n  train_batch_size: 8,\n  # another\n  "fp16": {"enabled": true,},\n}\n'
    )
    assert main(["config", "check", path, "--world-size", "2"]) == 0
    assert "batch 8 = 4 x 1 x 2, ZeRO 0, fp16" in capsys.readouterr().out


def test_check_summary_multiplies_out_under_sequence_parallel(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 4 ranks, sequence parallel 2 -> 2 data-parallel ranks: 8 = 4 x 1 x 2
    path = _write(tmp_path, {"train_batch_size": 8, "sequence_parallel_size": 2})
    assert main(["config", "check", path, "--world-size", "4"]) == 0
    assert "batch 8 = 4 x 1 x 2," in capsys.readouterr().out


def test_explain_says_what_stage3_keys_do_on_this_engine(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    zero = {
        "stage": 3,
        "overlap_comm": True,
        "stage3_prefetch_bucket_size": 1000,
        "zero_quantized_weights": True,
    }
    path = _write(tmp_path, {"train_batch_size": 8, "zero_optimization": zero})
    assert main(["config", "explain", path]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.startswith("  ")}
    assert (
        "[engine: accepted, no effect on this engine: FSDP2 always overlaps"
        in lines["zero_optimization.overlap_comm"]
    )
    assert "[engine: FSDP2 explicit prefetch" in lines["zero_optimization.stage3_prefetch_bucket_size"]
    assert "[engine: stage 3 (ZeRO++ qwZ): units are all-gathered as int8" in lines[
        "zero_optimization.zero_quantized_weights"
    ]
    # defaults are not annotated (that would be noise), nor are keys without a note
    assert "[engine:" not in lines["zero_optimization.stage3_max_live_parameters"]
    assert "[engine:" not in lines["train_batch_size"]


def test_explain_notes_stage3_keys_that_do_nothing_at_stage_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(
        tmp_path, {"train_batch_size": 8, "zero_optimization": {"stage": 2, "stage3_max_live_parameters": 10}}
    )
    assert main(["config", "explain", path]) == 0
    out = capsys.readouterr().out
    assert "[engine: stage-3 key: no effect at stage 2]" in out


def test_explain_says_what_overlap_comm_does_at_stages_1_and_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(tmp_path, {"train_batch_size": 8, "zero_optimization": {"stage": 2, "overlap_comm": True}})
    assert main(["config", "explain", path]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.startswith("  ")}
    line = lines["zero_optimization.overlap_comm"]
    assert "post-step all-gather" in line and "wait_for_parameters()" in line
    assert "no effect" not in line
