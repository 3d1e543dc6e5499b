"""Per-rank scenarios for test_engine_behaviour.py (module level so the harness can pickle them)."""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch
from torch import nn
from zero_reference import batch, make_model

import shardwise


def _cfg(stage: int = 1, **extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 3000},
    }
    for key, value in extra.items():
        cfg[key] = value
    return cfg


def _train(engine: Any, rank: int, steps: int, gas: int | None = None) -> list[float]:
    losses = []
    gas = gas or engine.gradient_accumulation_steps()
    for step in range(steps):
        for micro in range(gas):
            x, y = batch(step, micro, rank, engine.train_micro_batch_size_per_gpu())
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses


def _flat_params(engine: Any) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in engine.module.parameters()])


def overflow_skips_the_step(rank: int, world: int, stage: int) -> dict[str, Any]:
    """fp16: an inf gradient on rank 1 only makes every rank skip, halve later, not step the scheduler."""
    torch.set_num_threads(1)
    model = make_model()
    cfg = _cfg(
        stage,
        fp16={"enabled": True, "initial_scale_power": 4, "hysteresis": 2},
        scheduler={
            "type": "WarmupLR",
            "params": {
                "warmup_min_lr": 1e-3,
                "warmup_max_lr": 1e-2,
                "warmup_num_steps": 10,
                "warmup_type": "linear",
            },
        },
    )
    engine, _, _, sched = shardwise.initialize(model=model, config=cfg)
    record = []
    for step in range(4):
        x, y = batch(step, 0, rank, 2)
        before = _flat_params(engine)
        loss = engine(x, y)
        if step in (1, 2) and rank == 1:
            loss = loss * float("inf")
        engine.backward(loss)
        engine.step()
        changed = not torch.equal(before, _flat_params(engine))
        record.append(
            {
                "applied": engine.was_step_applied(),
                "changed": changed,
                "scale": engine.loss_scale,
                "skipped": engine.skipped_steps,
                "global_steps": engine.global_steps,
                "sched_iter": sched.last_batch_iteration,
                "norm": engine.get_global_grad_norm(),
            }
        )
    return {"record": record}


def frozen_and_unused_parameters(rank: int, world: int, stage: int) -> dict[str, Any]:
    """Frozen params are untouched; a param that gets no gradient in a step still steps with grad 0."""
    torch.set_num_threads(1)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.frozen = nn.Linear(4, 4)
            self.used = nn.Linear(4, 2)
            self.sometimes = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor, use_all: bool) -> torch.Tensor:
            h = self.frozen(x)
            out = self.used(h)
            if use_all:
                out = out + self.sometimes(h)
            return out.pow(2).mean()

    torch.manual_seed(0)
    net = Net()
    net.frozen.requires_grad_(False)
    frozen_before = net.frozen.weight.detach().clone()
    engine, _, _, _ = shardwise.initialize(
        model=net,
        config=_cfg(
            stage, optimizer={"type": "SGD", "params": {"lr": 0.1}}, zero_allow_untested_optimizer=True
        ),
    )
    sometimes = [net.sometimes.weight.detach().clone()]
    for step in range(3):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(step * 10 + rank))
        loss = engine(x, use_all=step == 1)
        engine.backward(loss)
        engine.step()
        sometimes.append(net.sometimes.weight.detach().clone())
    return {
        "frozen_equal": torch.equal(frozen_before, net.frozen.weight.detach()),
        "frozen_grad_none": net.frozen.weight.grad is None,
        # SGD without momentum: only the step that used it moves it; no stale gradient of the
        # previous window may reach the steps that did not use it
        "sometimes_moves": [not torch.equal(a, b) for a, b in itertools.pairwise(sometimes)],
        "steps": engine.global_steps,
    }


def no_sync_equals_accumulation(rank: int, world: int, stage: int) -> dict[str, Any]:
    """``no_sync`` + a final synced backward gives the same update as GAS=2."""
    torch.set_num_threads(1)
    results = {}
    for mode in ("gas", "no_sync"):
        model = make_model()
        gas = 2 if mode == "gas" else 1
        engine, _, _, _ = shardwise.initialize(
            model=model, config=_cfg(stage, gradient_accumulation_steps=gas)
        )
        x0, y0 = batch(0, 0, rank, 2)
        x1, y1 = batch(0, 1, rank, 2)
        if mode == "gas":
            for x, y in ((x0, y0), (x1, y1)):
                engine.backward(engine(x, y))
                engine.step()
        else:
            with engine.no_sync():
                engine.backward(engine(x0, y0) / 2)
            engine.backward(engine(x1, y1) / 2)
            engine.step()
        results[mode] = _flat_params(engine)
    return {"max_diff": float((results["gas"] - results["no_sync"]).abs().max())}


def no_sync_refused_at_stage_2(rank: int, world: int, stage: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    engine, _, _, _ = shardwise.initialize(model=make_model(), config=_cfg(2))
    try:
        with engine.no_sync():
            pass
    except RuntimeError as exc:
        return {"error": str(exc), "assertion": isinstance(exc, AssertionError)}  # DeepSpeed's type too
    return {"error": None}


def communication_options_keep_the_mean(rank: int, world: int, stage: int) -> dict[str, Any]:
    """Every averaging recipe and wire dtype gives (nearly) the same update as the default."""
    torch.set_num_threads(1)
    variants = {
        "default": {},
        "prescale": {"prescale_gradients": True},
        "predivide": {"gradient_predivide_factor": 2.0},
        "fp32_allreduce": {"fp32_allreduce": True},
        "comm_bf16": {"communication_data_type": "bf16"},
        "sum_op": {"gradient_allreduce_op": "sum"},
    }
    if stage == 2:
        variants.pop("prescale")
        variants.pop("predivide")
    out = {}
    for name, extra in variants.items():
        model = make_model()
        cfg = _cfg(
            stage,
            optimizer={"type": "SGD", "params": {"lr": 0.5}},
            zero_allow_untested_optimizer=True,
            **extra,
        )
        engine, _, _, _ = shardwise.initialize(model=model, config=cfg)
        start = _flat_params(engine)
        _train(engine, rank, 1)
        out[name] = (_flat_params(engine) - start).tolist()
    return out


def client_optimizer_and_schedulers(rank: int, world: int, stage: int) -> dict[str, Any]:
    """Client optimizer instance (re-pointed at ZeRO's tensors), callable, torch scheduler by name."""
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    model = make_model()
    client = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    cfg = _cfg(stage)
    cfg.pop("optimizer")
    cfg["scheduler"] = {"type": "StepLR", "params": {"step_size": 1, "gamma": 0.5}}
    engine, _, _, _sched = shardwise.initialize(model=model, optimizer=client, config=cfg)
    _train(engine, rank, 3)
    out["client_lrs"] = engine.get_lr()
    out["client_type"] = type(engine.optimizer.optimizer).__name__
    model = make_model()
    engine, _, _, _ = shardwise.initialize(
        model=model,
        optimizer=lambda groups: torch.optim.SGD(groups, lr=0.25),
        config={**_cfg(stage), "zero_allow_untested_optimizer": True},
    )
    _train(engine, rank, 1)
    out["callable_type"] = type(engine.optimizer.optimizer).__name__
    out["callable_lr"] = engine.get_lr()
    return out


def data_loader_and_counters(rank: int, world: int, stage: int) -> dict[str, Any]:
    """training_data -> a distributed loader; epochs reshuffle; counters follow DeepSpeed."""
    torch.set_num_threads(1)
    from shardwise.testing.models import TokenDataset

    data = TokenDataset(16, 16, 64)
    model = make_model()
    engine, _, loader, _ = shardwise.initialize(
        model=model, config=_cfg(stage, gradient_accumulation_steps=2), training_data=data
    )
    epoch_orders = []
    for _epoch in range(2):
        order = []
        for x, y in loader:
            order.append(x[:, 0].tolist())
            engine.backward(engine(x, y))
            engine.step()
        epoch_orders.append(order)
    return {
        "len": len(loader),
        "orders": epoch_orders,
        "global_steps": engine.global_steps,
        "micro_steps": engine.micro_steps,
        "global_samples": engine.global_samples,
        "batch_info": engine.get_batch_info(),
    }


def amp_and_autocast_train(rank: int, world: int, stage: int) -> dict[str, Any]:
    """Legacy amp and torch_autocast run the forward under autocast with fp32 parameters."""
    torch.set_num_threads(1)
    out = {}
    for name, extra in {
        "amp": {"amp": {"enabled": True, "opt_level": "O1"}},
        "autocast_bf16": {"torch_autocast": {"enabled": True, "dtype": "bf16"}},
    }.items():
        model = make_model()
        engine, _, _, _ = shardwise.initialize(model=model, config=_cfg(stage, **extra))
        seen: list[torch.dtype] = []
        hook = model.blocks[0].mlp[0].register_forward_hook(lambda m, i, o, seen=seen: seen.append(o.dtype))
        losses = _train(engine, rank, 4)
        hook.remove()
        out[name] = {
            "param_dtype": str(next(model.parameters()).dtype),
            "act_dtype": str(seen[0]),
            "finite": all(math.isfinite(v) for v in losses),
            "policy": engine.precision.name,
        }
    return out


def mpu_clipping_norm(rank: int, world: int, stage: int) -> dict[str, Any]:
    """With an mpu, tensor-parallel params count on every MP rank, replicated ones once."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    mp_group = dist.new_group([0, 1])
    dp_groups = [dist.new_group([r]) for r in range(world)]

    class MPU:
        def get_model_parallel_rank(self):
            return rank

        def get_model_parallel_group(self):
            return mp_group

        def get_model_parallel_world_size(self):
            return world

        def get_data_parallel_rank(self):
            return 0

        def get_data_parallel_group(self):
            return dp_groups[rank]

        def get_data_parallel_world_size(self):
            return 1

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 3, bias=False), nn.Linear(3, 1, bias=False))
    with torch.no_grad():
        net[0].weight.add_(rank)  # the tensor-parallel shard differs per MP rank
    net[0].weight.tensor_model_parallel = True
    engine, _, _, _ = shardwise.initialize(model=net, mpu=MPU(), config=_cfg(stage, gradient_clipping=1e6))
    x = torch.ones(2, 3)
    loss = net(x).pow(2).mean()
    grads = torch.autograd.grad(loss, list(net.parameters()))
    engine.backward(engine(x).pow(2).mean())
    engine.step()
    return {
        "norm": engine.get_global_grad_norm(),
        "tp_sq": float(grads[0].pow(2).sum()),
        "rep_sq": float(grads[1].pow(2).sum()),
    }


def reduction_overlaps_backward(rank: int, world: int, case: dict[str, int]) -> dict[str, Any]:
    """Stages 0-1 (gloo) reduce finished parts of a bucket while backward runs (pieces of
    ``case['chunk']`` elements: all-reduced at stage 0, exchanged between the shard owners at
    stage 1); the results must equal the one-bucket-at-the-end reduction."""
    import shardwise.zero.launch_order as launch_order
    from shardwise.comm import collectives, exchange

    torch.set_num_threads(1)
    calls: list[str] = []
    original_all_reduce, original_exchange = collectives.all_reduce, exchange.reduce_owned

    def counting(original: Any, name: str) -> Any:
        def call(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if tensor.numel() > 1:  # gradients, not a norm or a flag
                calls.append(name)
            return original(tensor, *args, **kwargs)

        return call

    launch_order.CHUNK_NUMEL = case["chunk"]
    collectives.all_reduce = counting(original_all_reduce, "all_reduce")  # type: ignore[assignment]
    exchange.reduce_owned = counting(original_exchange, "exchange")  # type: ignore[assignment]
    try:
        torch.manual_seed(0)
        engine, _, _, _ = shardwise.initialize(
            model=make_model(),
            config=_cfg(
                case["stage"],
                gradient_accumulation_steps=2,
                gradient_clipping=1.0,
                zero_optimization={"stage": case["stage"], "reduce_bucket_size": 10**6},  # one bucket
            ),
        )
        losses = _train(engine, rank, 3)
    finally:
        collectives.all_reduce, exchange.reduce_owned = original_all_reduce, original_exchange  # type: ignore[assignment]
    return {"losses": losses, "params": _flat_params(engine), "gradient_reductions": calls}


class _SharedBlocks(nn.Module):
    """One weight applied in several segments (ALBERT-style), optionally checkpointed."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.shared = nn.Linear(16, 16)
        self.side = nn.Linear(16, 16)
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, *, reentrant: bool | None, use_side: bool) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = torch.tanh(self.inp(x))
        for _ in range(3):
            if reentrant is None:
                h = torch.tanh(self.shared(h))
            else:
                h = checkpoint(lambda t: torch.tanh(self.shared(t)), h, use_reentrant=reentrant)
        if use_side:
            h = h + self.side(h)
        return self.out(h).pow(2).mean()


def divergent_gradient_patterns(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """Stages 0-2 with small reduction pieces: ranks whose hooks fire differently (rank 1 skips
    a parameter rank 0 uses) or twice per backward (reentrant checkpointing of a shared weight)
    still issue matching collectives and get the same result as plain backward."""
    import shardwise.zero.launch_order as launch_order

    torch.set_num_threads(1)
    launch_order.CHUNK_NUMEL = 64
    torch.manual_seed(0)
    net = _SharedBlocks()
    engine, _, _, _ = shardwise.initialize(
        model=net,
        config=_cfg(
            case["stage"],
            optimizer={"type": "SGD", "params": {"lr": 0.05}},
            zero_allow_untested_optimizer=True,
            zero_optimization={"stage": case["stage"], "reduce_bucket_size": 10**6},
        ),
    )
    losses = []
    for step in range(4):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step * 10 + rank))
        loss = engine(x, reentrant=case["reentrant"], use_side=rank == 0 or step % 2 == 0)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"losses": losses, "params": _flat_params(engine)}


def destroy_detaches_gradient_hooks(rank: int, world: int, stage: int) -> dict[str, Any]:
    """After ``engine.destroy()`` a backward on the module is plain autograd: no shardwise
    hook fires, nothing is reduced, and every parameter keeps autograd's own gradient."""
    from shardwise.comm import collectives
    from shardwise.comm.shared_memory import SharedBuffers

    torch.set_num_threads(1)
    engine, _, _, _ = shardwise.initialize(model=make_model(), config=_cfg(stage))
    _train(engine, rank, 2)  # the reducer has learned to launch reductions during backward
    fired: list[tuple[int, int]] = []
    for reducer, _ in engine.optimizer.reducer.members:  # one reducer per reduction domain
        on_grad = reducer._on_grad

        def counting_hook(gi: int, pi: int, param: torch.Tensor, on_grad: Any = on_grad) -> None:
            fired.append((gi, pi))
            on_grad(gi, pi, param)

        reducer._on_grad = counting_hook
    calls: list[str] = []
    names = ("all_reduce", "reduce_scatter_flat", "reduce_scatter_ranges")
    originals = {name: getattr(collectives, name) for name in names}

    def counting(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return originals[name](*args, **kwargs)

        return call

    for name in names:
        setattr(collectives, name, counting(name))
    # one host's ranks reduce through shared memory (stages 0-1) instead of these collectives
    shared_names = ("reduce_scatter", "all_reduce")
    shared_originals = {name: getattr(SharedBuffers, name) for name in shared_names}

    def counting_shared(name: str) -> Any:
        def call(self: SharedBuffers, *args: Any, **kwargs: Any) -> Any:
            calls.append(f"shared {name}")
            return shared_originals[name](self, *args, **kwargs)

        return call

    for name in shared_names:
        setattr(SharedBuffers, name, counting_shared(name))
    try:
        x, y = batch(2, 0, rank, 2)
        engine.backward(engine(x, y))
        engine.step()
        before = {"fired": len(fired), "collectives": len(calls)}
        fired.clear()
        calls.clear()
        engine.destroy()
        module = engine.module
        params = [p for p in module.parameters() if p.requires_grad]
        x, y = batch(3, 0, rank, 2)
        expected = torch.autograd.grad(module(x, y), params)
        module(x, y).backward()
    finally:
        for name in names:
            setattr(collectives, name, originals[name])
        for name in shared_names:
            setattr(SharedBuffers, name, shared_originals[name])
    return {
        "before": before,
        "after": {"fired": len(fired), "collectives": len(calls)},
        "grads_are_autograds": all(
            p.grad is not None and torch.equal(p.grad, g) for p, g in zip(params, expected)
        ),
    }
