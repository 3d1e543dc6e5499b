"""Per-rank cases of test_cuda_zero.py: ZeRO stages, precisions, offload and memory on one GPU.

Training reuses the CPU suites' code: ``zero_reference.rank_train`` (stages 0-2),
``stage3_cases.train`` (stage 3) and ``zero_reference.reference_run`` (the single-process
reference), here run on the rank's device. :func:`run_case` dispatches on ``case["kind"]``.
"""

from __future__ import annotations

import gc
from typing import Any

import torch
from cuda_support import device, to_cpu
from zero_reference import batch, config, make_model, rank_train, reference_run

import shardwise

STEPS, MICRO = 3, 2


def parity(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """The engine at ``case['stage']`` and the single-process reference, both on this device; with
    optimizer offload the reference's AdamW runs on the host too (``opt_device='cpu'``)."""
    import stage3_cases

    dev = device()
    train_case = {
        "stage": case["stage"],
        "precision": case["precision"],
        "gas": case["gas"],
        "micro_batch": MICRO,
        "steps": STEPS,
        "zero": dict(case.get("zero", {})),
    }
    if case["stage"] == 3:
        ours = stage3_cases.train(rank, world, train_case)
    else:
        ours = rank_train(rank, world, train_case)
    zero = case.get("zero", {})
    offloaded = zero.get("offload_optimizer", {}).get("device", "none") != "none"
    ref = reference_run(
        case["precision"],
        case["gas"],
        MICRO,
        world,
        STEPS,
        reduce_every_micro=case["stage"] >= 2,
        device=dev,
        opt_device="cpu" if offloaded else dev,
        # stages 0-2: each reference parameter at its engine twin's alignment (flat-buffer views)
        align_like=ours.get("param_alignment") if case["stage"] < 3 else None,
    )
    return {
        "device": str(dev),
        "engine": {k: to_cpu(ours[k]) for k in ("losses", "params", "steps", "skipped")},
        "reference": {k: to_cpu(ref[k]) for k in ("losses", "params")},
        "alignment": sorted(set(ours.get("param_alignment", []))),
    }


def zero_init(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """A TinyGPT built under ``zero.Init``, loaded with the reference weights through
    ``GatheredParameters``, trains at stage 3 like the reference on this device
    (stage3_cases.init_then_train)."""
    import stage3_cases

    dev = device()
    train_case = {"stage": 3, "precision": case["precision"], "gas": 1, "micro_batch": MICRO, "steps": STEPS}
    ours = stage3_cases.init_then_train(rank, world, train_case)
    ref = reference_run(case["precision"], 1, MICRO, world, STEPS, reduce_every_micro=True, device=dev)
    return {
        "device": str(dev),
        "tied": ours["tied"],
        "engine": {"losses": ours["losses"], "params": to_cpu(ours["params"]), "steps": STEPS, "skipped": 0},
        "reference": {k: to_cpu(ref[k]) for k in ("losses", "params")},
        "alignment": [],
    }


def _full_params(engine: Any) -> torch.Tensor:
    out = []
    for p in engine.module.parameters():
        value = p.full_tensor() if hasattr(p, "full_tensor") else p
        out.append(value.detach().float().reshape(-1).cpu())
    return torch.cat(out)


def fp16_overflow(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """fp16 with dynamic loss scaling: inf losses at steps 1 and 2 (hysteresis 2) skip both steps
    and halve the scale once, as on the CPU (test_engine_behaviour's overflow case)."""
    dev = device()
    cfg = config(case["stage"], "fp16", 1, MICRO, world, stage3_param_persistence_threshold=100)
    cfg["fp16"] = {"enabled": True, "initial_scale_power": 4, "hysteresis": 2}
    engine, *_ = shardwise.initialize(model=make_model(), config=cfg)
    record = []
    for step in range(4):
        x, y = batch(step, 0, rank, MICRO)
        before = _full_params(engine)
        loss = engine(x.to(dev), y.to(dev))
        if step in (1, 2):
            loss = loss * float("inf")
        engine.backward(loss)
        engine.step()
        record.append(
            {
                "applied": engine.was_step_applied(),
                "changed": not torch.equal(before, _full_params(engine)),
                "scale": engine.loss_scale,
                "skipped": engine.skipped_steps,
                "norm": engine.get_global_grad_norm(),
                "param_device": next(engine.module.parameters()).device.type,
            }
        )
    return {"record": to_cpu(record)}


def memory(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """Peak device memory (``torch.cuda.max_memory_allocated`` above what was allocated before the
    engine existed) over two training steps, without and with CPU optimizer offload."""
    from shardwise.testing.models import GPTConfig, TinyGPT

    dev = device()
    on_gpu = dev.type == "cuda"  # (on the CPU the same steps run, measuring nothing)
    shape = GPTConfig(vocab_size=1024, block_size=32, n_layer=2, n_head=4, n_embd=256, qkv_bias=False)
    peaks = {}
    numel = 0
    for name, zero in (("none", {}), ("cpu", {"offload_optimizer": {"device": "cpu", "pin_memory": True}})):
        gc.collect()
        base = 0
        if on_gpu:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        torch.manual_seed(0)
        model = TinyGPT(shape)
        numel = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
        if case["stage"] == 3:  # every parameter sharded by FSDP2, none kept whole below a threshold
            zero = {**zero, "stage3_param_persistence_threshold": 0}
        cfg = config(case["stage"], "fp32", 1, 2, world, **zero)
        engine, optimizer, _, _ = shardwise.initialize(model=model, config=cfg)
        gen = torch.Generator().manual_seed(rank)
        for _ in range(2):
            idx = torch.randint(0, shape.vocab_size, (2, shape.block_size), generator=gen).to(dev)
            loss = engine(idx, idx)
            engine.backward(loss)
            engine.step()
        if on_gpu:
            torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated() - base if on_gpu else None
        if hasattr(optimizer, "close"):
            optimizer.close()
        del engine, optimizer, model, loss
    return {"device": dev.type, "peaks": peaks, "numel": numel}


SCENARIOS = {"parity": parity, "zero_init": zero_init, "fp16_overflow": fp16_overflow, "memory": memory}


def run_case(rank: int, world: int, case: dict[str, Any]) -> Any:
    """Dispatch one case to its scenario."""
    return SCENARIOS[case["kind"]](rank, world, case)
