"""Per-rank scenarios and the single-process reference for test_muon_engine.py.

The reference is torch's own optimizers on the model: ``torch.optim.Muon`` for the parameters
DeepSpeed's rule gives Muon (matrices whose name has neither ``embed`` nor ``lm_head``) and
``torch.optim.AdamW`` (fused) for the rest, fed the ranks' gradients summed in the ranks' order and
divided by the world size, as the engine's all-reduce / reduce-scatter does (exact for 2 ranks).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from zero_reference import _full_masters, _micro_batch, make_model

import shardwise
from shardwise.optim.muon_groups import uses_muon
from shardwise.zero.offload import checkpoint_view

MUON = {"lr": 0.02, "momentum": 0.9, "weight_decay": 0.05, "muon_lr": 0.03, "adam_lr": 0.01, "ns_method": "standard"}
BETAS, EPS = (0.9, 0.99), 1e-8


def config(stage: int, gas: int, micro_batch: int, **zero: Any) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": gas,
        # no clipping: torch's Newton-Schulz runs in bf16, so any rounding difference in the gradients
        # (a clip factor applied in another order) moves the update far beyond 1e-6; unclipped, the
        # engine's gradients are the reference's bit for bit
        "gradient_clipping": 0.0,
        "optimizer": {"type": "Muon", "params": {**MUON, "betas": list(BETAS), "eps": EPS}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 3000, **zero},
    }


def reference(world: int, steps: int, micro_batch: int, gas: int = 1, reduce_every_micro: bool = False) -> dict[str, Any]:
    """Final weights (model order) of the single-process torch.optim.Muon + AdamW run.

    The ranks' micro batches (the same samples the engine's ``same_data`` split sees) are run one
    by one; each rank's ``loss / gas`` gradients are accumulated and the ranks' sums added in rank
    order (stages 0-1), or the ranks' gradients of each micro batch are summed and those sums
    accumulated (``reduce_every_micro``: stages 2-3), then divided by the world size, as the
    engine's reductions do.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = make_model()
        named = list(model.named_parameters())
        matrices = [p for n, p in named if uses_muon(n, p.shape)]
        rest = [p for n, p in named if not uses_muon(n, p.shape)]
        muon = torch.optim.Muon(matrices, lr=MUON["muon_lr"], momentum=MUON["momentum"], weight_decay=MUON["weight_decay"])
        adamw = torch.optim.AdamW(rest, lr=MUON["adam_lr"], betas=BETAS, eps=EPS, weight_decay=MUON["weight_decay"], fused=True)
        case = {"micro_batch": micro_batch, "gas": gas, "same_data": True}
        for step in range(steps):
            grads: dict[tuple[int, int], list[torch.Tensor]] = {}
            for rank in range(world):
                for micro in range(gas):
                    model.zero_grad(set_to_none=True)
                    x, y = _micro_batch(case, step, micro, rank)
                    loss = model(x, y)
                    (loss / gas if gas > 1 else loss).backward()
                    grads[(micro, rank)] = [p.grad.clone() for _, p in named]
            for i, (_, p) in enumerate(named):
                if reduce_every_micro:
                    total = torch.zeros_like(p)
                    for micro in range(gas):
                        summed = grads[(micro, 0)][i].clone()
                        for rank in range(1, world):
                            summed.add_(grads[(micro, rank)][i])
                        total.add_(summed)
                else:
                    per_rank = []
                    for rank in range(world):
                        acc = torch.zeros_like(p)
                        for micro in range(gas):
                            acc.add_(grads[(micro, rank)][i])
                        per_rank.append(acc)
                    total = per_rank[0].clone()
                    for rank in range(1, world):
                        total.add_(per_rank[rank])
                p.grad = total / world
            muon.step()
            adamw.step()
        return {"params": [p.detach().clone() for _, p in named], "matrices": len(matrices)}
    finally:
        torch.set_num_threads(threads)


def _weights(engine: Any, stage: int) -> list[torch.Tensor]:
    if stage == 3:
        return engine.optimizer.full_fp32_parameters()
    return _full_masters(engine)


def build_engine(rank: int, case: dict[str, Any], make: Callable[[], torch.nn.Module] = make_model) -> Any:
    """The engine for ``case`` (stage, gas, micro_batch, optional zero keys and ``init``: zero.Init)
    on ``make()``'s model; under zero.Init rank 0 loads a plain build's values (Init draws others)."""
    cfg = config(case["stage"], case["gas"], case["micro_batch"], **case.get("zero", {}))
    if case.get("init"):
        with shardwise.zero.Init(config_dict_or_path=cfg):
            model = make()
        reference = make().state_dict()
        with shardwise.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
            if rank == 0:
                model.load_state_dict(reference)
    else:
        model = make()
    engine, _, _, _ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def report(engine: Any, stage: int) -> dict[str, Any]:
    """Final weights, the Newton-Schulz counters and the optimizer state as measured on this rank.

    ``state_per_element``: for the Muon half and the AdamW half, the elements of the per-parameter
    state tensors (scalars such as AdamW's ``step`` left out) over the elements of the tensors the
    optimizer steps (whole matrices, flat shards or FSDP2 shards; with NVMe offload read back from
    the swap file): 1.0 is one buffer per parameter, 2.0 two."""
    proxy = engine.optimizer.optimizer
    inner = getattr(proxy, "inner", proxy)  # inside optimizer offload's proxy
    view = checkpoint_view(proxy)
    muon_params = [p for g in view.param_groups if g["use_muon"] for p in g["params"]]
    state_keys = sorted({tuple(sorted(view.state[p])) for p in muon_params if p in view.state})
    per_element = {}
    for flag in (True, False):
        params = [p for g in view.param_groups if g["use_muon"] is flag for p in g["params"]]
        held = sum(
            t.numel() for p in params for t in view.state.get(p, {}).values() if torch.is_tensor(t) and t.dim() > 0
        )
        per_element["muon" if flag else "adamw"] = held / max(1, sum(p.numel() for p in params))
    return {
        "params": _weights(engine, stage),
        "optimizer": type(inner).__name__,
        "ns_matrices": inner.newton_schulz_matrices,
        "ns_iterations": inner.newton_schulz_iterations,
        "muon_state_keys": state_keys,
        "state_per_element": per_element,
        "steps": engine.global_steps,
        # DeepSpeed's engine.basic_optimizer: the torch optimizer ZeRO wraps, with the halves' settings
        "basic_lrs": sorted({(g["use_muon"], g["lr"]) for g in engine.basic_optimizer.param_groups}),
        "mom": engine.get_mom(),
    }


def train(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """``case``: stage, gas, micro_batch, steps, optional zero keys and ``init`` (zero.Init)."""
    torch.set_num_threads(1)
    engine = build_engine(rank, case)
    for step in range(case["steps"]):
        for micro in range(case["gas"]):
            x, y = _micro_batch({**case, "same_data": True}, step, micro, rank)
            engine.backward(engine(x, y))
            engine.step()
    return report(engine, case["stage"])


def _full_state(engine: Any) -> dict[str, torch.Tensor]:
    """Every parameter's fp32 value and Muon / AdamW state, whole (collective)."""
    from shardwise.zero.param_access import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out: dict[str, torch.Tensor] = {}
    for name, param in engine.module.named_parameters():
        out[f"{name}/fp32"] = safe_get_full_fp32_param(param)
        keys = ("momentum_buffer",) if getattr(param, "use_muon", False) else ("exp_avg", "exp_avg_sq")
        for key in keys:
            out[f"{name}/{key}"] = safe_get_full_optimizer_state(param, key)
    return out


def save_state(rank: int, world: int, case: dict[str, Any], path: str) -> dict[str, torch.Tensor]:
    """Train 3 steps at ``case['stage']`` and save; the whole values and state saved."""
    torch.set_num_threads(1)
    model = make_model()
    engine, _, _, _ = shardwise.initialize(model=model, config=config(case["stage"], 1, 2))
    for step in range(3):
        x, y = _micro_batch({"micro_batch": 2, "gas": 1}, step, 0, rank)
        engine.backward(engine(x, y))
        engine.step()
    engine.save_checkpoint(path, tag="muon")
    return _full_state(engine)


def load_state(rank: int, world: int, case: dict[str, Any], path: str) -> dict[str, torch.Tensor]:
    """Load the checkpoint at ``case['stage']`` on this world size; the whole values and state."""
    torch.set_num_threads(1)
    model = make_model(seed=1)  # other values: the load must bring the saved ones
    engine, _, _, _ = shardwise.initialize(model=model, config=config(case["stage"], 1, 2))
    engine.load_checkpoint(path, tag="muon")
    return _full_state(engine)
