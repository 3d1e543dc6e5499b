"""Monitor backends, read back with each format's own reader, and the fan-out."""

from __future__ import annotations

import csv
import glob
import json
import os
import struct
import sys
import types
from typing import Any

import pytest
import torch

from shardwise.config import ConfigError, load_config
from shardwise.monitor import MonitorMaster, build_monitor, check_events
from shardwise.monitor.comet_monitor import CometMonitor
from shardwise.monitor.csv_monitor import CSVMonitor, csv_file_name
from shardwise.monitor.tensorboard_monitor import TensorBoardMonitor

EVENTS = [
    ("Train/Samples/train_loss", 2.5, 8),
    ("Train/Samples/lr", 0.01, 8),
    ("Train/Samples/train_loss", 2.25, 16),
    ("Train/Samples/lr", 0.005, 16),
]


def _rows(path: str) -> list[list[str]]:
    with open(path, newline="") as handle:
        return list(csv.reader(handle))


def test_csv_monitor_layout_and_restart(tmp_path):
    mon = CSVMonitor(str(tmp_path), "job")
    mon.write_events(check_events(EVENTS))
    mon.close()
    assert sorted(os.listdir(tmp_path / "job")) == ["Train_Samples_lr.csv", "Train_Samples_train_loss.csv"]
    assert _rows(str(tmp_path / "job" / "Train_Samples_lr.csv")) == [
        ["step", "lr"],
        ["8", "0.01"],
        ["16", "0.005"],
    ]
    # a restarted run appends, with a new header (as DeepSpeed does)
    again = CSVMonitor(str(tmp_path), "job")
    again.write_events([("Train/Samples/lr", 0.0025, 24)])
    again.close()
    assert _rows(str(tmp_path / "job" / "Train_Samples_lr.csv"))[3:] == [["step", "lr"], ["24", "0.0025"]]
    assert csv_file_name("My metric/with space") == "My_metric_with_space.csv"


def test_csv_monitor_empty_output_path_is_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    mon = CSVMonitor("", "run1")
    mon.write_events([("Custom/x", 1.0, 1)])
    mon.close()
    assert _rows(str(tmp_path / "run1" / "Custom_x.csv")) == [["step", "x"], ["1", "1.0"]]


def test_tensorboard_monitor_writes_real_event_files(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    mon = TensorBoardMonitor(str(tmp_path), "job")
    mon.write_events(check_events(EVENTS))
    # readable while the writer is still open: write_events flushes
    acc = EventAccumulator(str(tmp_path / "job"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("Train/Samples/train_loss")] == [(8, 2.5), (16, 2.25)]
    got = [(e.step, e.value) for e in acc.Scalars("Train/Samples/lr")]
    assert [s for s, _ in got] == [8, 16]
    assert [v for _, v in got] == pytest.approx([0.01, 0.005], rel=1e-7)
    mon.close()


def _read_wandb(run_file: str) -> tuple[dict[str, Any], list[dict]]:
    """Parse a W&B offline ``.wandb`` file: 32 KiB blocks of 7-byte-header records, each a protobuf."""
    from wandb.proto import wandb_internal_pb2 as pb

    with open(run_file, "rb") as handle:
        raw = handle.read()
    assert raw[:4] == b":W&B"
    pos, block, pending, records = 7, 32768, b"", []
    while pos + 7 <= len(raw):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        pos += 7
        if kind == 0:
            break
        pending += raw[pos : pos + length]
        pos += length
        if kind in (1, 4):
            records.append(pending)
            pending = b""
    info: dict[str, Any] = {}
    history = []
    for data in records:
        record = pb.Record()
        record.ParseFromString(data)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            info = {"project": record.run.project, "group": record.run.run_group}
            info.update({f"config.{i.key}": json.loads(i.value_json) for i in record.run.config.update})
        elif kind == "history":
            history.append(
                {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item
                }
            )
    return info, history


def test_wandb_monitor_offline_run_files(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = load_config(
        {
            "train_batch_size": 8,
            "zero_optimization": {"stage": 2},
            "wandb": {"enabled": True, "project": "proj", "group": "grp", "team": None},
        }
    )
    master = build_monitor(cfg, rank=0)
    master.write_events(EVENTS)
    master.close()
    import wandb

    wandb.teardown()  # wandb-core writes the offline file out completely when its service stops
    (run_file,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    info, history = _read_wandb(run_file)
    assert (info["project"], info["group"]) == ("proj", "grp")
    # the resolved config is the run's config: runs compare by ZeRO stage, batch size...
    assert info["config.train_batch_size"] == 8 and info["config.zero_optimization"]["stage"] == 2
    for name in ("Train/Samples/train_loss", "Train/Samples/lr"):
        assert [(row["_step"], row[name]) for row in history if name in row] == [
            (step, value) for n, value, step in EVENTS if n == name
        ]


@pytest.mark.parametrize(
    ("section", "module", "package"),
    [
        ("wandb", "wandb", "wandb"),
        ("comet", "comet_ml", "comet_ml"),
        ("tensorboard", "tensorboard", "tensorboard"),
    ],
)
def test_missing_package_is_a_clear_config_error(monkeypatch, section, module, package):
    monkeypatch.setitem(sys.modules, module, None)  # makes ``import module`` raise ImportError
    cfg = load_config({"train_batch_size": 8, section: {"enabled": True}})
    with pytest.raises(ConfigError) as info:
        build_monitor(cfg.config, rank=0)
    message = str(info.value)
    assert f"'{section}.enabled'" in message and f"pip install {package}" in message
    # other ranks construct nothing, so they do not need the package
    assert build_monitor(cfg.config, rank=1).enabled


def test_optional_packages_are_imported_only_when_enabled(tmp_path, monkeypatch):
    for module in ("wandb", "comet_ml"):
        monkeypatch.setitem(sys.modules, module, None)
    cfg = load_config(
        {
            "train_batch_size": 8,
            "csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "j"},
        }
    )
    master = build_monitor(cfg.config, rank=0)
    assert master.enabled and [m.name for m in master.monitors] == ["csv_monitor"]
    master.close()


class _FakeExperiment:
    def __init__(self) -> None:
        self.logged: list[tuple[str, float, int]] = []
        self.ended = False

    def log_metric(self, name: str, value: float, step: int) -> None:
        self.logged.append((name, value, step))

    def end(self) -> None:
        self.ended = True


def test_comet_monitor_throttles_by_samples(monkeypatch):
    # comet_ml is not installed here: a stand-in module records what the monitor calls
    started: dict = {}
    experiment = _FakeExperiment()
    fake = types.ModuleType("comet_ml")

    def start(api_key=None, workspace=None, project_name=None, experiment_key=None, mode=None, online=None,
              experiment_config=None):  # fmt: skip
        started.update(project_name=project_name, online=online, name=experiment_config.name)
        return experiment

    fake.start = start
    fake.ExperimentConfig = lambda name=None: types.SimpleNamespace(name=name)
    monkeypatch.setitem(sys.modules, "comet_ml", fake)
    mon = CometMonitor(samples_log_interval=16, project="p", experiment_name="exp", online=False)
    assert started == {"project_name": "p", "online": False, "name": "exp"}
    for step in (8, 16, 24, 32, 40):
        mon.write_events([("Train/Samples/lr", step / 100, step)])
    # first value, then only once 16 more samples have passed
    assert experiment.logged == [
        ("Train/Samples/lr", 0.08, 8),
        ("Train/Samples/lr", 0.24, 24),
        ("Train/Samples/lr", 0.4, 40),
    ]
    mon.close()
    assert experiment.ended


def test_master_rank_gating_and_event_validation(tmp_path):
    cfg = load_config(
        {
            "train_batch_size": 8,
            "csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "j"},
        }
    )
    other = build_monitor(cfg.config, rank=1)
    assert other.enabled and not other.writes
    other.write_events([("Custom/x", 1.0, 8)])
    assert not (tmp_path / "j").exists()  # rank 1 created nothing
    master = build_monitor(cfg.config, rank=0)
    master.write_events([("Custom/x", torch.tensor(1.5), torch.tensor(8))])  # 0-d tensors are fine
    master.close()
    assert _rows(str(tmp_path / "j" / "Custom_x.csv")) == [["step", "x"], ["8", "1.5"]]
    assert not MonitorMaster().enabled
    for bad in [("x", 1.0), ("", 1.0, 1), ("x", "high", 1), ("x", 1.0, 1.5), ("x", torch.ones(2), 1)]:
        with pytest.raises(ValueError):
            master.write_events([bad])
