"""Per-rank scenarios for test_step_semantics.py: non-finite steps in every precision and stage,
the consecutive limit, step() without backward(), and the step-hook seam through initialize,
training and a real checkpoint save/load. Module level so the harness can pickle them."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from zero_reference import batch, config, make_model

import shardwise
import shardwise.initialization as initialization
from shardwise.runtime.nonfinite import NonFiniteStepsError
from shardwise.runtime.step_hooks import StepHooks
from shardwise.utils.logging import get_logger

NAN_STEP = 1  # the loop's step index whose loss is NaN (global step 2)


class _Warnings(logging.Handler):
    """Collects the library's warnings on this rank."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def __enter__(self) -> _Warnings:
        get_logger().addHandler(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        get_logger().removeHandler(self)


def _local_params(engine: Any) -> torch.Tensor:
    """This rank's parameter values (the local shard at stage 3), flat in fp32."""
    parts = []
    for p in engine.module.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        parts.append(local.detach().float().reshape(-1))
    return torch.cat(parts)


def nonfinite_step(rank: int, world: int, case: tuple[int, str, bool]) -> dict[str, Any]:
    """A NaN loss on rank 1 only, in one micro batch of step 2: every rank skips that step, once."""
    torch.set_num_threads(1)
    stage, precision, check = case
    zero = {"stage3_param_persistence_threshold": 100} if stage == 3 else {}
    cfg = config(stage, precision, gas=2, micro_batch=2, world=world, clip=1.0, **zero)
    if precision == "bf16":
        cfg["bf16"]["check_grad_overflow"] = check
    engine, *_ = shardwise.initialize(model=make_model(), config=cfg)
    record = []
    with _Warnings() as warnings:
        for step in range(4):
            before = _local_params(engine)
            for micro in range(2):
                x, y = batch(step, micro, rank, 2)
                loss = engine(x, y)
                if step == NAN_STEP and micro == 0 and rank == 1:
                    loss = loss * float("nan")
                engine.backward(loss)
                engine.step()
            after = _local_params(engine)
            record.append(
                {
                    "applied": engine.was_step_applied(),
                    "changed": not torch.equal(before, after),
                    "finite": bool(torch.isfinite(after).all()),
                    "skipped": engine.skipped_steps,
                    "global_steps": engine.global_steps,
                    "norm": engine.get_global_grad_norm(),
                    "scale": engine.loss_scale,
                }
            )
    return {
        "record": record,
        "warnings": [m for m in warnings.messages if "not finite" in m],
        "scaler_overflow_iter": engine.precision.loss_scaler.last_overflow_iter,
    }


def nonfinite_limit(rank: int, world: int) -> dict[str, Any]:
    """NaN losses every step with max_consecutive_nonfinite_steps=3: the third step raises."""
    torch.set_num_threads(1)
    cfg = config(1, "fp32", gas=1, micro_batch=2, world=world)
    cfg["max_consecutive_nonfinite_steps"] = 3
    engine, *_ = shardwise.initialize(model=make_model(), config=cfg)
    error = None
    with _Warnings():
        # a finite step between NaN ones resets the count: 2 NaN, 1 finite, then NaN until the error
        for step in range(10):
            x, y = batch(step, 0, rank, 2)
            loss = engine(x, y)
            if step != 2:
                loss = loss * float("nan")
            engine.backward(loss)
            try:
                engine.step()
            except NonFiniteStepsError as exc:
                error = str(exc)
                break
    return {
        "error": error,
        "global_steps": engine.global_steps,
        "skipped": engine.skipped_steps,
        "finite": bool(torch.isfinite(_local_params(engine)).all()),
    }


def step_without_backward(rank: int, world: int) -> dict[str, Any]:
    """step() with no backward() since the previous step() moves nothing and warns (GAS 2)."""
    torch.set_num_threads(1)
    engine, *_ = shardwise.initialize(
        model=make_model(), config=config(1, "fp32", gas=2, micro_batch=2, world=world)
    )

    def counters() -> tuple[int, int, int, int]:
        return (engine.global_steps, engine.global_samples, engine.micro_steps, engine.skipped_steps)

    out: dict[str, Any] = {}
    with _Warnings() as warnings:
        start = _local_params(engine)
        engine.step()  # nothing happened yet
        out["first"] = counters()
        out["unchanged"] = torch.equal(start, _local_params(engine))
        for micro in range(2):
            x, y = batch(0, micro, rank, 2)
            engine.backward(engine(x, y))
            engine.step()
            engine.step()  # a second step() after one backward
        out["window"] = counters()
        out["changed"] = not torch.equal(start, _local_params(engine))
    out["warnings"] = [m for m in warnings.messages if "was ignored" in m]
    return out


class SeqlenNet(nn.Module):
    """Regression on the first ``curriculum_seqlen`` positions; records the lengths it was given."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(4, 4)
        self.seen: list[int | None] = []

    def forward(self, x: torch.Tensor, y: torch.Tensor, curriculum_seqlen: int | None = None) -> torch.Tensor:
        self.seen.append(curriculum_seqlen)
        length = curriculum_seqlen or x.shape[1]
        return nn.functional.mse_loss(self.proj(x[:, :length]), y[:, :length])


class Seqlen:
    """A curriculum-like hook: ``curriculum_seqlen`` grows with the global step."""

    name = "seqlen"

    def __init__(self, calls: list[tuple[Any, ...]]) -> None:
        self.calls = calls
        self.steps_seen = 0

    def adjust_forward(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], context: Any
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        self.calls.append(("seqlen.forward", context.global_step, context.training))
        return args, {**kwargs, "curriculum_seqlen": 2 + context.global_step}

    def after_optimizer_step(self, outcome: Any) -> None:
        self.calls.append(("seqlen.step", outcome.global_step, outcome.applied))
        self.steps_seen += 1

    def state_dict(self) -> dict[str, Any]:
        return {"steps_seen": self.steps_seen}

    def load_state_dict(self, state: Any) -> None:
        self.steps_seen = int(state["steps_seen"])


class Watcher:
    """Runs after ``Seqlen``: sees the kwargs the previous hook produced."""

    name = "watcher"

    def __init__(self, calls: list[tuple[Any, ...]]) -> None:
        self.calls = calls
        self.loaded: Any = None

    def adjust_forward(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], context: Any
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        self.calls.append(("watcher.forward", kwargs.get("curriculum_seqlen")))
        return args, kwargs

    def after_optimizer_step(self, outcome: Any) -> None:
        self.calls.append(("watcher.step", outcome.global_step))

    def state_dict(self) -> dict[str, Any]:
        return {"marker": "w"}

    def load_state_dict(self, state: Any) -> None:
        self.loaded = dict(state)


def _engine_with(hooks: list[Any]) -> Any:
    """``initialize`` with ``build_step_hooks`` returning ``hooks`` (as a config-built feature would)."""
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": 1},
    }
    original = initialization.build_step_hooks
    initialization.build_step_hooks = lambda *args, **kwargs: StepHooks(hooks)  # type: ignore[assignment]
    try:
        engine, *_ = shardwise.initialize(model=SeqlenNet(), config=cfg)
    finally:
        initialization.build_step_hooks = original
    return engine


def step_hook_seam(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """Hooks built at initialize are called in order around forward and after each optimizer step,
    adjust the forward's kwargs, and their state goes through a real checkpoint save/load."""
    torch.set_num_threads(1)
    calls: list[tuple[Any, ...]] = []
    engine = _engine_with([Seqlen(calls), Watcher(calls)])
    gen = torch.Generator().manual_seed(rank)
    for _step in range(2):
        for _micro in range(2):
            x, y = torch.randn(2, 6, 4, generator=gen), torch.randn(2, 6, 4, generator=gen)
            engine.backward(engine(x, y))
            engine.step()
    engine.eval()
    with torch.no_grad():
        engine(x, y)
    engine.train()
    engine.save_checkpoint(f"{tmp}/hooks")
    out: dict[str, Any] = {"calls": calls, "seen": list(engine.module.seen)}
    # a fresh engine with fresh hooks: the checkpoint restores their state
    resumed_hooks = [Seqlen([]), Watcher([])]
    resumed = _engine_with(resumed_hooks)
    resumed.load_checkpoint(f"{tmp}/hooks")
    out["restored"] = (resumed_hooks[0].steps_seen, resumed_hooks[1].loaded, resumed.global_steps)
    # a checkpoint without hook state (saved by an engine without hooks) loads: hooks keep theirs
    plain = _engine_with([])
    plain.save_checkpoint(f"{tmp}/plain")
    older_hooks = [Seqlen([]), Watcher([])]
    older_hooks[0].steps_seen = 7
    _engine_with(older_hooks).load_checkpoint(f"{tmp}/plain")
    out["kept"] = (older_hooks[0].steps_seen, older_hooks[1].loaded)
    # hook state nobody takes back is named in a warning
    with _Warnings() as warnings:
        _engine_with([]).load_checkpoint(f"{tmp}/hooks")
    out["unused_warning"] = [m for m in warnings.messages if "step hooks" in m]
    return out


def run_scenario(rank: int, world: int, case: Any, tmp: str) -> Any:
    """Dispatch one case (all share one spawn)."""
    if isinstance(case, tuple):
        return nonfinite_step(rank, world, case)
    if case == "limit":
        return nonfinite_limit(rank, world)
    if case == "no_backward":
        return step_without_backward(rank, world)
    return step_hook_seam(rank, world, tmp)
