"""docs/architecture.md's step order is the code's: the parts ``engine.step()`` calls at an
accumulation boundary, spied on a real single-process engine, are called in the order the page lists.

The page's **Step** paragraph lists the parts as a numbered list, each item starting with the
part's name in backticks; this test maps each name to a spy and compares the orders.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

import shardwise
from shardwise.checkpoint import snapshot_io

ARCHITECTURE = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


def documented_step_order() -> list[str]:
    """The numbered items of the **Step** paragraph, by the name each item starts with."""
    text = ARCHITECTURE.read_text()
    section = text[text.index("**Step**") : text.index("**Save**")]
    return re.findall(r"^\d+\. `([^`]+)`", section, flags=re.MULTILINE)


def _spy(calls: list[str], name: str, function: Any) -> Any:
    def recorded(*args: Any, **kwargs: Any) -> Any:
        calls.append(name)
        return function(*args, **kwargs)

    return recorded


def observed_step_order(snapshot_dir: Path, monkeypatch: Any) -> list[str]:
    """The parts a boundary ``engine.step()`` calls, in calling order (a model that trains: no skip;
    snapshots every step)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}},
        "checkpoint": {"snapshot_interval": 1, "snapshot_dir": str(snapshot_dir)},
    }
    engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=config)
    calls: list[str] = []
    counters = engine.counters

    class RecordingCounters(type(counters)):  # type: ignore[misc]
        def __setattr__(self, key: str, value: Any) -> None:
            if key == "global_steps":
                calls.append("EngineCounters")
            super().__setattr__(key, value)

    counters.__class__ = RecordingCounters
    strategy, scaler = engine.optimizer, engine.precision.loss_scaler
    strategy.step = _spy(calls, "strategy.step", strategy.step)
    scaler.update_scale = _spy(calls, "loss_scaler.update_scale", scaler.update_scale)
    engine.lr_scheduler.step = _spy(calls, "lr_scheduler.step", engine.lr_scheduler.step)
    engine._nonfinite.record = _spy(calls, "NonFiniteSteps.record", engine._nonfinite.record)
    engine.telemetry.after_step = _spy(calls, "telemetry.after_step", engine.telemetry.after_step)
    engine.telemetry.on_boundary = _spy(calls, "telemetry.on_boundary", engine.telemetry.on_boundary)
    hooks = engine.step_hooks
    hooks.after_optimizer_step = _spy(calls, "StepHooks.after_optimizer_step", hooks.after_optimizer_step)
    name = "checkpoint.snapshot_io.after_optimizer_step"
    monkeypatch.setattr(snapshot_io, "after_optimizer_step", _spy(calls, name, snapshot_io.after_optimizer_step))
    for micro in range(2):
        x = torch.full((2, 4), float(micro + 1))
        engine.backward(engine(x).square().mean())
        engine.step()
        if micro == 0:  # not a boundary: only the step timer closes
            assert calls == ["telemetry.after_step"], f"a micro step that is not a boundary called {calls}"
            calls.clear()
    engine.destroy()
    return calls


def test_the_documented_step_order_is_the_order_the_engine_calls_its_parts(tmp_path: Path, monkeypatch) -> None:
    documented = documented_step_order()
    assert len(documented) >= 7, f"docs/architecture.md's **Step** list was not found: {documented}"
    assert observed_step_order(tmp_path / "snapshots", monkeypatch) == documented
    assert (tmp_path / "snapshots" / "snapshot_step1").is_dir()  # the spied call took the snapshot
