"""The periodic-snapshot policy (pure) and one engine in this process taking and resuming snapshots."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import shardwise
from shardwise import ConfigError, load_config
from shardwise.checkpoint.integrity import CheckpointIntegrityError
from shardwise.checkpoint.snapshots import (
    Candidate,
    ResumeReport,
    SnapshotPolicy,
    newest_first,
    policy_from_config,
    read_progress,
    snapshot_step,
    step_from_tag,
    write_progress,
)
from shardwise.cli.main import main


def test_a_snapshot_is_due_every_interval_steps_and_never_at_step_zero() -> None:
    policy = SnapshotPolicy(interval=3, directory=Path("s"))
    assert [step for step in range(0, 13) if policy.due(step)] == [3, 6, 9, 12]
    assert policy.tag(9) == "snapshot_step9" and snapshot_step(policy.tag(9)) == 9
    assert snapshot_step("global_step9") is None and snapshot_step("snapshot_stepx") is None
    assert step_from_tag("global_step17") == 17 and step_from_tag("final") is None


@pytest.mark.parametrize(("interval", "keep"), [(0, 1), (2, 0), (-1, 1)])
def test_a_policy_without_an_interval_or_keep_is_refused(interval: int, keep: int) -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        SnapshotPolicy(interval=interval, directory=Path("s"), keep=keep)


def test_pruning_keeps_the_newest_snapshots_by_step_and_never_touches_other_tags() -> None:
    tags = ["snapshot_step10", "global_step3", "snapshot_step2", "snapshot_step8", "final"]
    assert SnapshotPolicy(2, Path("s"), keep=1).to_prune(tags) == ["snapshot_step2", "snapshot_step8"]
    assert SnapshotPolicy(2, Path("s"), keep=2).to_prune(tags) == ["snapshot_step2"]
    assert SnapshotPolicy(2, Path("s"), keep=5).to_prune(tags) == []
    # the tag being written is replaced by the save, so it does not count as kept
    assert SnapshotPolicy(2, Path("s"), keep=1).to_prune(tags, writing="snapshot_step10") == ["snapshot_step2"]


def test_a_resume_tries_the_highest_step_first_and_the_scripts_checkpoint_before_a_snapshot() -> None:
    own = Candidate(Path("ckpt/global_step6"), 6, snapshot=False)
    snaps = [Candidate(Path(f"s/snapshot_step{n}"), n, snapshot=True) for n in (4, 6, 8)]
    order = newest_first([snaps[0], own, snaps[2], snaps[1], own])
    assert [c.path.name for c in order] == ["snapshot_step8", "global_step6", "snapshot_step6", "snapshot_step4"]


def test_the_report_line_says_where_it_resumed_and_how_many_steps_are_redone() -> None:
    report = ResumeReport(step=4, path=Path("s/snapshot_step4"), snapshot=True, reached=5, attempt=1,
                          world_size=1, saved_world_size=2, skipped=("s/snapshot_step6: damaged",))  # fmt: skip
    assert report.redone == 1 and report.after_failure
    assert str(report) == (
        "restart 1: resumed at step 4 from snapshot s/snapshot_step4; the previous run reached step 5: "
        "1 step(s) redone; world size 2 -> 1; skipped (did not verify): s/snapshot_step6: damaged"
    )
    quiet = ResumeReport(step=4, path=Path("c/global_step4"), snapshot=False, reached=4)
    assert quiet.redone == 0 and not quiet.after_failure
    assert "unknown" in str(ResumeReport(step=4, path=Path("c/x"), snapshot=False))


def test_the_progress_mark_round_trips_and_a_torn_one_reads_as_none(tmp_path: Path) -> None:
    assert read_progress(tmp_path) is None
    write_progress(tmp_path / "snaps", 7, world_size=2, attempt=1)
    assert read_progress(tmp_path / "snaps") == {"global_step": 7, "world_size": 2, "attempt": 1}
    (tmp_path / "snaps" / "progress.json").write_text('{"global_st')
    assert read_progress(tmp_path / "snaps") is None


def test_the_config_keys_are_validated_and_listed_by_config_check(tmp_path: Path, capsys) -> None:
    base = {"train_batch_size": 8}
    assert policy_from_config(load_config(base).config.checkpoint) is None
    section = load_config({**base, "checkpoint": {"snapshot_interval": 5, "snapshot_dir": "s", "snapshot_keep": 2}})
    assert policy_from_config(section.config.checkpoint) == SnapshotPolicy(5, Path("s"), 2)
    with pytest.raises(ConfigError, match=r"checkpoint\.snapshot_dir.*snapshot_interval 5 needs a directory"):
        load_config({**base, "checkpoint": {"snapshot_interval": 5}})
    for key, value in (("snapshot_interval", -1), ("snapshot_keep", 0)):
        with pytest.raises(ConfigError, match=rf"checkpoint\.{key}' = {value}"):
            load_config({**base, "checkpoint": {key: value, "snapshot_dir": "s"}})
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**base, "checkpoint": {"snapshot_interval": 5, "snapshot_dir": "snaps"}}))
    assert main(["config", "check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "snapshots: every 5 optimizer steps into snaps (asynchronous; the 1 newest kept)" in out


def _engine(snaps: Path) -> tuple[shardwise.ShardwiseEngine, object]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    data = [(torch.randn(4), torch.randn(1)) for _ in range(64)]
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "checkpoint": {"snapshot_interval": 2, "snapshot_dir": str(snaps)}}  # fmt: skip
    engine, _, loader, _ = shardwise.initialize(
        model=model, model_parameters=model.parameters(), config=config, training_data=data
    )
    return engine, loader


def _train(engine, batches, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        x, y = next(batches)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def test_an_engine_snapshots_by_itself_and_a_fresh_one_resumes_from_the_newest_that_verifies(tmp_path: Path) -> None:
    snaps = tmp_path / "snaps"
    engine, loader = _engine(snaps)
    batches = iter(loader)
    _train(engine, batches, 7)
    expected = _train(engine, batches, 3)  # steps 8-10 of an uninterrupted run
    engine.wait_for_checkpoint()
    # keep 1 besides the one written: the step-8 snapshot was written while step 6's stayed
    assert sorted(p.name for p in snaps.iterdir() if p.is_dir()) == ["snapshot_step10", "snapshot_step8"]
    assert (snaps / "latest").read_text() == "snapshot_step10"
    engine.destroy()

    # (a plain resume from the newest snapshot is the checkpoints page's example)
    # damage step 10's snapshot: the resume skips it, loads step 8 (data position too) and says so
    victim = next(f for f in sorted((snaps / "snapshot_step10").iterdir()) if f.suffix == ".distcp")
    victim.write_bytes(b"\0" * victim.stat().st_size)
    engine, loader = _engine(snaps)
    path, _ = engine.load_checkpoint(tmp_path / "ckpt")
    report = engine.snapshots.last_resume
    assert Path(path).name == "snapshot_step8" and report.reached == 10 and report.redone == 2
    assert len(report.skipped) == 1 and "snapshot_step10" in report.skipped[0]
    assert _train(engine, iter(loader), 2) == expected[1:]  # steps 9-10 bit-identical: same samples, same state

    engine.destroy()  # its step-10 snapshot is published; now every snapshot is damaged
    for snapshot in snaps.glob("snapshot_step*"):
        for data in snapshot.glob("*.distcp"):
            data.write_bytes(b"\0")
    engine, _ = _engine(snaps)
    with pytest.raises(CheckpointIntegrityError, match="no checkpoint to resume from verifies"):
        engine.load_checkpoint(tmp_path / "ckpt")


def test_a_snapshot_is_written_in_the_background_even_without_async_save(tmp_path: Path, monkeypatch, caplog) -> None:
    """The step returns once the state is copied: the write waits here on an event, the loop does not."""
    import threading

    from shardwise.checkpoint import publish

    release, real = threading.Event(), publish.write_and_publish

    def held_write(*args, **kwargs):
        assert release.wait(60), "the test never released the write"
        return real(*args, **kwargs)

    monkeypatch.setattr(publish, "write_and_publish", held_write)
    snaps = tmp_path / "snaps"
    engine, loader = _engine(snaps)
    assert not engine.checkpointer.options.async_save
    batches = iter(loader)
    _train(engine, batches, 2)  # step 2 starts a snapshot whose write is held
    _train(engine, batches, 1)  # and training goes on meanwhile
    assert engine.global_steps == 3 and not (snaps / "snapshot_step2").exists()
    release.set()
    engine.wait_for_checkpoint()
    assert (snaps / "latest").read_text() == "snapshot_step2"
    engine.destroy()


    # a restarted run that never calls load_checkpoint is told it trains from scratch beside a snapshot
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    restarted, loader = _engine(snaps)
    _train(restarted, iter(loader), 1)
    restarted.destroy()
    said = caplog.text
    assert f"restart 1: {snaps} holds snapshot snapshot_step2 but this run loaded none" in said, said
