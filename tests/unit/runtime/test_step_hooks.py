"""The step-hook seam without a process group: calling order, kwargs, state by name, the profiler hook.

The same seam through initialize, training and a real checkpoint save/load is in
tests/distributed/test_step_semantics.py."""

from __future__ import annotations

import logging
import re
from typing import Any

import pytest
import torch
from torch import nn

from shardwise.config import load_config
from shardwise.profiling.flops_hook import FlopsProfilerHook
from shardwise.profiling.flops_profiler import FlopsProfiler, format_count
from shardwise.profiling.timers import WallClockTimers
from shardwise.runtime.step_hooks import ForwardContext, StepHooks, StepOutcome
from shardwise.utils.logging import get_logger


class _Hook:
    def __init__(self, name: str, log: list[Any]) -> None:
        self.name = name
        self.log = log
        self.state: dict[str, Any] = {"name": name}

    def adjust_forward(self, args, kwargs, context):
        self.log.append((self.name, "forward", dict(kwargs), context.global_step))
        return (*args, self.name), {**kwargs, self.name: context.training}

    def after_optimizer_step(self, outcome):
        self.log.append((self.name, "step", outcome.global_step, outcome.applied))

    def state_dict(self):
        return dict(self.state)

    def load_state_dict(self, state):
        self.state = dict(state)


def test_hooks_run_in_order_each_seeing_the_previous_output():
    log: list[Any] = []
    hooks = StepHooks([_Hook("a", log), _Hook("b", log)])
    args, kwargs = hooks.adjust_forward((1,), {"x": 0}, ForwardContext(global_step=3, training=True))
    assert args == (1, "a", "b") and kwargs == {"x": 0, "a": True, "b": True}
    hooks.after_optimizer_step(
        StepOutcome(global_step=4, global_samples=32, applied=False, grad_norm=float("inf"))
    )
    assert log == [
        ("a", "forward", {"x": 0}, 3),
        ("b", "forward", {"x": 0, "a": True}, 3),
        ("a", "step", 4, False),
        ("b", "step", 4, False),
    ]
    assert [h.name for h in hooks] == ["a", "b"] and len(hooks) == 2


def test_state_is_keyed_by_name_and_missing_entries_keep_the_hook_state(caplog):
    a, b = _Hook("a", []), _Hook("b", [])
    hooks = StepHooks([a, b])
    assert hooks.state_dict() == {"a": {"name": "a"}, "b": {"name": "b"}}
    caplog.set_level(logging.WARNING, logger="shardwise")
    get_logger().addHandler(caplog.handler)
    try:
        hooks.load_state_dict({"b": {"name": "restored"}})  # no entry for a: an older checkpoint
        assert a.state == {"name": "a"} and b.state == {"name": "restored"}
        assert not caplog.records
        hooks.load_state_dict({"a": {"n": 1}, "gone": {}})
    finally:
        get_logger().removeHandler(caplog.handler)
    assert a.state == {"n": 1}
    assert len(caplog.records) == 1 and "(gone)" in caplog.records[0].getMessage()


@pytest.mark.parametrize("names", [["a", "a"], [""]])
def test_names_must_be_unique_and_non_empty(names):
    with pytest.raises(ValueError, match="name"):
        StepHooks([_Hook(n, []) for n in names])


def test_the_flops_profiler_hook_profiles_the_training_forwards_of_profile_step(tmp_path):
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    out = tmp_path / "flops.txt"
    settings = load_config(
        {
            "train_batch_size": 8,
            "flops_profiler": {"enabled": True, "profile_step": 2, "output_file": str(out)},
        }
    ).config.flops_profiler
    hook = FlopsProfilerHook(FlopsProfiler(model), settings, WallClockTimers(True), {"world_size": 1})
    x = torch.randn(3, 4)

    def forward(step: int, training: bool = True) -> None:
        assert hook.adjust_forward((x,), {}, ForwardContext(global_step=step, training=training)) == (
            (x,),
            {},
        )
        model(x)

    forward(1)
    hook.after_optimizer_step(StepOutcome(2, 16, True, 1.0))
    forward(2, training=False)  # an evaluation forward at the profiled step: not profiled
    assert not hook.profiling and hook.profiler.get_total_flops() == 0
    forward(2)
    forward(2)
    assert hook.profiling
    hook.after_optimizer_step(StepOutcome(3, 24, True, 1.0))
    assert not hook.profiling and out.exists() and "fwd flops per rank" in out.read_text()
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()) == 0
    flops = 2 * 2 * 3 * (4 * 8 + 8 * 2)  # the profiled step's two forwards of 3 rows
    assert re.search(rf"fwd flops per rank:\s+{re.escape(format_count(flops))}\n", out.read_text())
    forward(3)
    assert not hook.profiling and hook.state_dict() == {}
