"""One-rank scenarios for test_initialize_api.py."""

from __future__ import annotations

import argparse
import json
import logging
from typing import Any

import torch
from zero_reference import batch, make_model

import shardwise
from shardwise.config import ConfigError
from shardwise.utils.logging import logger

BASE = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


def _error(fn) -> str:
    try:
        fn()
    except (ConfigError, RuntimeError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return ""


def api_scenarios(rank: int, world: int, tmp: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    path = f"{tmp}/ds.json"
    with open(path, "w") as fh:
        json.dump(BASE, fh)
    parser = shardwise.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", path])
    engine, opt, loader, sched = shardwise.initialize(args=args, model=make_model())
    out["from_args"] = (engine.train_batch_size(), type(opt).__name__, loader, sched)  # stage 0 fp32: bare
    alias = parser.parse_args(["--shardwise_config", path])
    out["alias"] = shardwise.initialize(args=alias, model=make_model())[0].train_micro_batch_size_per_gpu()
    out["config_params"] = shardwise.initialize(model=make_model(), config_params=BASE)[0].train_batch_size()
    out["both"] = _error(lambda: shardwise.initialize(args=args, model=make_model(), config=BASE))
    out["none"] = _error(lambda: shardwise.initialize(model=make_model()))
    out["no_model"] = _error(lambda: shardwise.initialize(config=BASE))
    bare, bare_opt, _, _ = shardwise.initialize(model=make_model(), config={"train_batch_size": 2})
    x, y = batch(0, 0, 0, 2)
    out["no_optimizer"] = (bare_opt, _error(lambda: bare.backward(bare(x, y))))
    engine3, _, _, _ = shardwise.initialize(
        model=make_model(), config={**BASE, "zero_optimization": {"stage": 3}}
    )
    engine3.backward(engine3(x, y))
    engine3.step()
    out["stage3"] = (engine3.zero_optimization_stage(), engine3.global_steps)
    lamb = {**BASE, "optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}
    out["lamb_stage1"] = _error(
        lambda: shardwise.initialize(model=make_model(), config={**lamb, "zero_optimization": {"stage": 1}})
    )
    engine0, _, _, _ = shardwise.initialize(model=make_model(), config=lamb)
    engine0.backward(engine0(x, y))
    engine0.step()
    out["lamb_stage0_steps"] = engine0.global_steps
    engine.set_train_batch_size(8)
    out["set_tbs"] = engine.get_batch_info()
    saved = engine.config.to_ds_dict()
    out["set_tbs_config"] = (
        engine.config.config.train_batch_size,
        saved["train_micro_batch_size_per_gpu"],
        saved["gradient_accumulation_steps"],
    )
    out["bad_tbs"] = _error(lambda: engine.set_train_batch_size(3))
    engine.set_train_micro_batch_size(1)
    out["set_mbs"] = engine.get_batch_info()
    out["getattr"] = engine.config.config.zero_optimization.stage, engine.wte is engine.module.wte
    out.update(_config_trust_scenarios(tmp))
    return out


def _config_trust_scenarios(tmp: str) -> dict[str, Any]:
    """Bad learning rates and unreadable files name the key or file; ignored settings warn once."""
    out: dict[str, Any] = {}
    for name, lr in (("fast", "fast"), ("nan", float("nan")), ("negative", -1e-3)):
        config = {**BASE, "optimizer": {"type": "AdamW", "params": {"lr": lr}}}
        out[f"lr_{name}"] = _error(
            lambda config=config: shardwise.initialize(model=make_model(), config=config)
        )
    latin1 = f"{tmp}/latin1.json"
    with open(latin1, "wb") as fh:
        fh.write(b'{"train_batch_size": 2, "name": "caf\xe9"}')
    out["not_utf8"] = _error(lambda: shardwise.initialize(model=make_model(), config=latin1))
    records: list[logging.LogRecord] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    keep = _Keep(level=logging.WARNING)
    logger.addHandler(keep)
    try:
        ignored = {**BASE, "zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}
        shardwise.initialize(model=make_model(), config=ignored)
    finally:
        logger.removeHandler(keep)
    out["offload_param_warnings"] = [r.getMessage() for r in records if "offload_param" in r.getMessage()]
    return out


class _OddBuffers(torch.nn.Module):
    """A linear layer with a transposed (non-contiguous) buffer and an expanded (memory-sharing) one."""

    def __init__(self, rank: int, same_expanded: bool) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("transposed", torch.arange(12.0).view(3, 4).t() + 100 * rank)
        row = torch.ones(4) * (0 if same_expanded else rank)
        self.register_buffer("expanded", row.expand(3, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).sum()


def odd_buffers(rank: int, world: int) -> dict[str, Any]:
    """Buffers that are views are made equal to rank 0's without touching memory they do not own."""
    torch.set_num_threads(1)
    model = _OddBuffers(rank, same_expanded=True)
    shardwise.initialize(model=model, config=BASE)
    out: dict[str, Any] = {"transposed": model.transposed.tolist(), "expanded": model.expanded.tolist()}
    out["differs"] = _error(
        lambda: shardwise.initialize(model=_OddBuffers(rank, same_expanded=False), config=BASE)
    )
    return out


def _trained_weights(cfg: dict[str, Any], zero_grad_calls: bool) -> list[torch.Tensor]:
    """Two steps; with ``zero_grad_calls`` the script also calls zero_grad() on the optimizer
    initialize returned, before the forward and between backward and step (as scripts do)."""
    model = make_model(0)
    engine, returned, _, _ = shardwise.initialize(model=model, config=cfg)
    for step in range(2):
        if zero_grad_calls:
            returned.zero_grad()
        x, y = batch(step, 0, 0, 2)
        engine.backward(engine(x, y))
        if zero_grad_calls:
            returned.zero_grad()  # DeepSpeed: clears param.grad only; the engine steps its own
        engine.step()
    return [p.detach().clone() for p in model.parameters()]


def returned_optimizers(rank: int, world: int) -> dict[str, Any]:
    """What initialize returns as the optimizer, DeepSpeed's choice, and that using it is safe."""
    from shardwise.compat.ops import FusedAdam

    out: dict[str, Any] = {}
    plain = {"train_micro_batch_size_per_gpu": 2}
    model = make_model()
    client = torch.optim.Adam(model.parameters(), lr=1e-3)
    engine, returned, _, _ = shardwise.initialize(model=model, optimizer=client, config=plain)
    out["client_object"] = returned is client and engine.optimizer.optimizer is client
    model = make_model()
    _, returned, _, _ = shardwise.initialize(
        model=model, optimizer=lambda groups: torch.optim.AdamW(groups), config=plain
    )
    out["callable_class"] = type(returned).__name__
    for parameters in (True, False):
        model = make_model()
        _, returned, _, _ = shardwise.initialize(
            model=model, model_parameters=list(model.parameters()) if parameters else None, config=BASE
        )
        out[f"config_fusedadam_{parameters}"] = isinstance(returned, FusedAdam)
    for name, extra in {
        "stage1": {"zero_optimization": {"stage": 1}},
        "bf16": {"bf16": {"enabled": True}},
    }.items():
        engine, returned, _, _ = shardwise.initialize(model=make_model(), config={**BASE, **extra})
        out[f"{name}_strategy"] = returned is engine.optimizer
    start = [p.detach().clone() for p in make_model(0).parameters()]
    quiet = _trained_weights(dict(BASE), zero_grad_calls=False)
    noisy = _trained_weights(dict(BASE), zero_grad_calls=True)
    out["trained"] = all(not torch.equal(a, b) for a, b in zip(start, quiet))
    out["zero_grad_harmless"] = all(torch.equal(a, b) for a, b in zip(quiet, noisy))
    return out


def offload_client_optimizers(rank: int, world: int) -> dict[str, Any]:
    """zero_force_ds_cpu_optimizer: a client torch optimizer with optimizer offload is refused
    unless the key is false; DeepSpeedCPUAdam is accepted."""
    from shardwise.compat.ops import DeepSpeedCPUAdam
    from shardwise.compat.small_names import ZeRORuntimeException

    cfg = {**BASE, "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}
    cfg.pop("optimizer")
    out: dict[str, Any] = {}
    model = make_model()
    try:
        shardwise.initialize(model=model, optimizer=torch.optim.Adam(model.parameters()), config=cfg)
        out["forced"] = "accepted"
    except ZeRORuntimeException as error:
        out["forced"] = str(error)
    model = make_model()
    off = {**cfg, "zero_force_ds_cpu_optimizer": False}
    engine, _, _, _ = shardwise.initialize(model=model, optimizer=torch.optim.Adam(model.parameters()), config=off)
    out["opted_out"] = type(engine.optimizer.optimizer.inner).__name__
    model = make_model()
    engine, _, _, _ = shardwise.initialize(model=model, optimizer=DeepSpeedCPUAdam(model.parameters()), config=cfg)
    out["cpu_adam"] = type(engine.optimizer.optimizer.inner).__name__
    return out
