"""Checkpoint integrity in one process: every file checksummed at save, damage named at load,
old checkpoints still loading with a note, and ``shardwise checkpoint verify|info|export``."""

from __future__ import annotations

import itertools
import json
import logging
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from shardwise.checkpoint import checksums, integrity, layout
from shardwise.checkpoint.checkpointer import Checkpointer, CheckpointOptions, TrainingState
from shardwise.checkpoint.export import checkpoint_info, export_checkpoint
from shardwise.checkpoint.integrity import CheckpointIntegrityError
from shardwise.checkpoint.param_state import ParamOptimizerState
from shardwise.checkpoint.training_state import StatePart
from shardwise.cli.main import main
from shardwise.runtime.counters import EngineCounters
from shardwise.utils.logging import get_logger

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "deepspeed_ckpt"
SHARDS = ["__0_0.distcp", "__0_1.distcp"]  # thread_count=2: one process writes two data files
EVERY_FILE = [layout.DCP_METADATA, *SHARDS, layout.SUMMARY]


@pytest.fixture(autouse=True)
def _quiet_dcp():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _state(seed: int) -> TrainingState:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 32)).sum().backward()
    opt.step()
    parts = {"counters": StatePart(EngineCounters(global_steps=seed))}
    return TrainingState(module=model, optimizer=ParamOptimizerState(opt), parts=parts)


def _save(root: Path, tags: tuple[str, ...] = ("good", "bad")) -> Checkpointer:
    ckpt = Checkpointer(CheckpointOptions(thread_count=2))
    for i, tag in enumerate(tags):
        ckpt.save(_state(i + 1), root, tag=tag)
    return ckpt


def _params(state: TrainingState) -> list[torch.Tensor]:
    return [p.detach().clone() for p in state.module.parameters()]


def _load_error(root: Path, tag: str | None = None) -> tuple[str, bool]:
    """Load into a fresh state; the error message and whether the state stayed untouched."""
    target = _state(7)
    before = _params(target)
    with pytest.raises(CheckpointIntegrityError) as info:
        Checkpointer(CheckpointOptions()).load(target, root, tag)
    untouched = all(torch.equal(a, b) for a, b in zip(before, _params(target)))
    return str(info.value), untouched


def _flip(path: Path, at: float = 0.5, count: int = 1) -> None:
    data = bytearray(path.read_bytes())
    start = int(len(data) * at)
    for i in range(start, start + count):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _strip_checksums(tag_dir: Path) -> None:
    """Make a tag look like one saved before checksums existed (format version 1)."""
    summary = json.loads((tag_dir / layout.SUMMARY).read_text())
    for key in ("checksums", integrity.SEAL_KEY):
        summary.pop(key)
    summary["format_version"] = 1
    (tag_dir / layout.SUMMARY).write_text(json.dumps(summary, indent=1, sort_keys=True))


# ---------------------------------------------------------------------------- what a save records
def test_a_save_records_the_checksum_of_every_file_and_item(tmp_path):
    _save(tmp_path, ("good",))
    tag_dir = tmp_path / "good"
    assert sorted(p.name for p in tag_dir.iterdir()) == sorted(EVERY_FILE)
    summary = json.loads((tag_dir / layout.SUMMARY).read_text())
    files = summary["checksums"]["files"]
    assert summary["checksums"]["algorithm"] == checksums.ALGORITHM and summary["format_version"] == 2
    assert sorted(files) == sorted([layout.DCP_METADATA, *SHARDS])
    for name, record in files.items():
        assert record["bytes"] == (tag_dir / name).stat().st_size
        assert record[checksums.ALGORITHM] == checksums.file_digest(tag_dir / name)[1]
    items = [line.split(" ", 3) for name in SHARDS for line in files[name]["items"]]
    assert {"common", "rank/0", "model/0.weight", "optim/0.weight/exp_avg"} <= {i[3] for i in items}
    assert all(files[name]["rank"] == 0 for name in SHARDS)
    # the items tile each data file, so every byte is covered twice: per file and per item
    for name in SHARDS:
        spans = sorted((int(o), int(n)) for o, n, *_ in (line.split(" ", 3) for line in files[name]["items"]))
        assert spans[0][0] == 0 and all(a + n == b for (a, n), (b, _) in itertools.pairwise(spans))
        assert sum(n for _, n in spans) == files[name]["bytes"]
    assert integrity.verify_tag(tag_dir).status == "ok"


def test_the_summary_seal_covers_every_byte_even_whitespace(tmp_path):
    _save(tmp_path, ("good",))
    path = tmp_path / "good" / layout.SUMMARY
    raw = path.read_bytes()
    assert integrity.read_checked_summary(tmp_path / "good")[1] is None
    path.write_bytes(raw.replace(b'\n "zero_stage"', b'\n  "zero_stage"', 1))  # still valid JSON
    summary, problem = integrity.read_checked_summary(tmp_path / "good")
    assert summary is None and problem is not None and "expected crc32" in problem


def test_a_checksum_algorithm_this_version_does_not_know_is_reported_unverified(tmp_path):
    _save(tmp_path, ("good",))
    summary = json.loads((tmp_path / "good" / layout.SUMMARY).read_text())
    summary["checksums"]["algorithm"] = "future-hash"
    integrity.write_sealed_summary(tmp_path / "good", summary)
    verdict = integrity.verify_tag(tmp_path / "good")
    assert verdict.status == "unverified" and "'future-hash', unknown" in verdict.detail


# ---------------------------------------------------------------------------- damage is named at load
@pytest.mark.parametrize("name", EVERY_FILE)
def test_a_flipped_byte_in_any_file_fails_the_load_naming_it(tmp_path, name):
    _save(tmp_path)
    _flip(tmp_path / "bad" / name)
    message, untouched = _load_error(tmp_path)  # 'latest' names the damaged tag
    assert "checkpoint tag 'bad'" in message and name in message
    assert "expected" in message and "found" in message
    assert "the last tag in" in message and "that verifies is 'good'" in message
    assert untouched  # verified before a byte was used
    assert integrity.verify_tag(tmp_path / "good").status == "ok"


def test_64_bytes_of_ff_in_a_shard_name_the_damaged_entries(tmp_path):
    _save(tmp_path)
    path = tmp_path / "bad" / SHARDS[0]
    data = bytearray(path.read_bytes())
    data[3000:3064] = b"\xff" * 64
    path.write_bytes(bytes(data))
    message, untouched = _load_error(tmp_path, "bad")
    assert f"{SHARDS[0]}: expected {checksums.ALGORITHM}" in message and "damaged entries:" in message and untouched
    damaged = message.split("damaged entries: ")[1]
    record = json.loads((tmp_path / "bad" / layout.SUMMARY).read_text())["checksums"]["files"][SHARDS[0]]
    hit = [line.split(" ", 3)[3] for line in record["items"] if _covers(line, 3000, 3064)]
    assert hit and all(name in damaged for name in hit)


def _covers(line: str, lo: int, hi: int) -> bool:
    offset, length = (int(v) for v in line.split(" ", 2)[:2])
    return offset < hi and lo < offset + length


@pytest.mark.parametrize(
    ("name", "keep", "found"),
    [
        (layout.DCP_METADATA, 0.5, "(truncated)"),
        (SHARDS[1], 0.5, "(truncated)"),
        (SHARDS[0], 0.0, "found 0 bytes (empty)"),
        (layout.SUMMARY, 0.5, "expected JSON"),
    ],
)
def test_a_truncated_or_empty_file_fails_the_load_naming_it(tmp_path, name, keep, found):
    _save(tmp_path)
    path = tmp_path / "bad" / name
    size = path.stat().st_size
    path.write_bytes(path.read_bytes()[: int(size * keep)])
    message, untouched = _load_error(tmp_path)
    assert f"{name}: expected" in message and found in message and "'good'" in message and untouched
    if name != layout.SUMMARY:
        assert f"expected {size} bytes" in message


@pytest.mark.parametrize("name", EVERY_FILE)
def test_a_missing_file_fails_the_load_naming_it(tmp_path, name):
    _save(tmp_path)
    (tmp_path / "bad" / name).unlink()
    message, untouched = _load_error(tmp_path)
    assert f"{name}: expected" in message and "found no file" in message and untouched
    assert "that verifies is 'good'" in message


def test_without_an_intact_tag_the_error_says_so(tmp_path):
    _save(tmp_path, ("only",))
    _flip(tmp_path / "only" / SHARDS[1])
    message, _ = _load_error(tmp_path)
    assert f"no other tag in {tmp_path} verifies" in message


# ---------------------------------------------------------------------------- older checkpoints
class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_a_checkpoint_without_checksums_loads_with_one_note(tmp_path):
    _save(tmp_path, ("old",))
    _strip_checksums(tmp_path / "old")
    handler = _Records()
    get_logger().addHandler(handler)
    try:
        for _ in range(2):
            target = _state(7)
            result = Checkpointer(CheckpointOptions()).load(target, tmp_path)
            assert result is not None and result.path == tmp_path / "old"
            assert all(torch.equal(a, b) for a, b in zip(_params(target), _params(_state(1))))
    finally:
        get_logger().removeHandler(handler)
    notes = [m for m in handler.messages if "has no checksums" in m]
    assert len(notes) == 1 and "old" in notes[0] and "unverified" in notes[0]


@pytest.mark.parametrize(
    ("name", "found"), [(layout.DCP_METADATA, "cannot be read"), (SHARDS[0], "found 0 bytes (empty)")]
)
def test_damage_in_a_checkpoint_without_checksums_is_still_named(tmp_path, name, found):
    """Structure only: an unreadable index, or a file shorter than DCP's index says."""
    _save(tmp_path)
    _strip_checksums(tmp_path / "bad")
    path = tmp_path / "bad" / name
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2 if name == layout.DCP_METADATA else 0])
    message, untouched = _load_error(tmp_path)
    assert f"{name}: " in message and found in message and "'good'" in message and untouched


def test_deepspeed_checkpoints_are_checked_by_their_zip_crcs(tmp_path):
    assert integrity.verify_tag(FIXTURES / "stage1" / "global_step2").status == "ok"
    shutil.copytree(FIXTURES / "stage1", tmp_path / "ds")
    shard = tmp_path / "ds" / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    _flip(shard, at=0.3)
    verdict = integrity.verify_tag(tmp_path / "ds" / "global_step2")
    assert verdict.damaged and shard.name in verdict.problems[0] and "CRC-32" in verdict.problems[0]
    model = tmp_path / "ds" / "global_step2" / "mp_rank_00_model_states.pt"
    for cut in (model.stat().st_size // 2, 0):  # truncated, then empty
        model.write_bytes(model.read_bytes()[:cut])
        quick = integrity.verify_tag(tmp_path / "ds" / "global_step2", read=integrity.read_none)
        assert quick.damaged and any(p.startswith(model.name) for p in quick.problems)


# ---------------------------------------------------------------------------- the CLI
def test_cli_verify_prints_one_line_per_tag_and_fails_on_damage(tmp_path, capsys):
    _save(tmp_path)
    assert main(["checkpoint", "verify", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["good", "bad"]
    assert all(": ok (" in line for line in lines)
    _flip(tmp_path / "bad" / SHARDS[0])
    assert main(["checkpoint", "verify", str(tmp_path)]) == 1
    good, bad = capsys.readouterr().out.splitlines()
    assert good.startswith("good: ok") and bad.startswith("bad: DAMAGED: " + SHARDS[0])
    assert main(["checkpoint", "verify", str(tmp_path), "--tag", "good"]) == 0
    assert capsys.readouterr().out.startswith("good: ok")
    assert main(["checkpoint", "verify", str(tmp_path / "bad")]) == 1  # a tag directory itself
    _strip_checksums(tmp_path / "good")
    assert main(["checkpoint", "verify", str(tmp_path), "--tag", "good"]) == 0
    assert "good: unverified (saved without checksums" in capsys.readouterr().out
    assert main(["checkpoint", "verify", str(tmp_path / "nothing")]) == 1
    assert "holds no checkpoint" in capsys.readouterr().err
    assert main(["checkpoint", "verify", str(FIXTURES / "stage2")]) == 0
    assert "global_step2: ok (3 DeepSpeed files" in capsys.readouterr().out


def test_cli_info_marks_truncated_and_damaged_tags_without_tracebacks(tmp_path, capsys):
    _save(tmp_path, ("good", "short", "index", "flipped"))
    shard = tmp_path / "short" / SHARDS[1]
    shard.write_bytes(shard.read_bytes()[:100])
    (tmp_path / "index" / layout.DCP_METADATA).write_bytes(b"\x80\x04garbage")
    _flip(tmp_path / "flipped" / SHARDS[0])
    assert main(["checkpoint", "info", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    lines = {line.split(":")[0].strip(): line for line in out.splitlines()[1:]}
    assert "sizes ok" in lines["good"] and "sizes ok" in lines["flipped"]  # sizes only without --verify
    assert f"DAMAGED: {SHARDS[1]}: expected" in lines["short"] and "(truncated)" in lines["short"]
    assert f"DAMAGED: {layout.DCP_METADATA}: expected" in lines["index"]
    assert main(["checkpoint", "info", str(tmp_path), "--verify"]) == 0
    lines = {line.split(":")[0].strip(): line for line in capsys.readouterr().out.splitlines()[1:]}
    assert "checksums ok" in lines["good"] and f"DAMAGED: {SHARDS[0]}" in lines["flipped"]
    info = checkpoint_info(tmp_path)
    assert [t["integrity"] for t in info["tags"]] == ["ok", "damaged", "damaged", "ok"]


def test_cli_info_and_export_on_an_old_checkpoint_with_a_damaged_index(tmp_path, capsys):
    _save(tmp_path, ("old",))
    _strip_checksums(tmp_path / "old")
    (tmp_path / "old" / layout.DCP_METADATA).write_bytes(b"\x80\x04\x95garbage")
    assert main(["checkpoint", "info", str(tmp_path)]) == 0
    assert f"DAMAGED: {layout.DCP_METADATA}: cannot be read" in capsys.readouterr().out
    assert main(["checkpoint", "export", str(tmp_path), str(tmp_path / "out.safetensors")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: checkpoint tag 'old'") and "Traceback" not in err
    assert not (tmp_path / "out.safetensors").exists()


def test_cli_export_refuses_a_damaged_tag_and_exports_an_intact_one(tmp_path, capsys):
    _save(tmp_path)
    _flip(tmp_path / "bad" / SHARDS[1])
    out = tmp_path / "model.safetensors"
    assert main(["checkpoint", "export", str(tmp_path), str(out)]) == 1
    err = capsys.readouterr().err
    assert "checkpoint tag 'bad'" in err and SHARDS[1] in err and "that verifies is 'good'" in err
    assert not out.exists()
    with pytest.raises(CheckpointIntegrityError, match="damaged"):
        export_checkpoint(tmp_path, out)
    assert main(["checkpoint", "export", str(tmp_path), str(out), "--tag", "good"]) == 0
    assert out.is_file()


def test_a_checkpoint_checksummed_with_crc32_still_verifies_and_damage_is_named(tmp_path, monkeypatch):
    """Saves before the switch to XXH3 recorded CRC-32: verification follows the recorded name."""
    monkeypatch.setattr(checksums, "ALGORITHM", "crc32")
    _save(tmp_path, ("old",))
    monkeypatch.undo()
    assert checksums.ALGORITHM != "crc32"
    summary = json.loads((tmp_path / "old" / layout.SUMMARY).read_text())
    assert summary["checksums"]["algorithm"] == "crc32"
    assert integrity.verify_tag(tmp_path / "old").status == "ok"
    _flip(tmp_path / "old" / SHARDS[0])
    verdict = integrity.verify_tag(tmp_path / "old")
    assert verdict.damaged and any(f"{SHARDS[0]}: expected crc32" in p for p in verdict.problems)
