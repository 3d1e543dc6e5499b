"""Per-rank scenario for test_compile_blocks.py (module level so the harness can pickle it)."""

from __future__ import annotations

from typing import Any

from zero_reference import batch, make_model

import shardwise

STEPS = 50


def _engine(stage: int, gas: int) -> Any:
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        # stage 3: no parameter kept whole (the default threshold would keep every tiny one), so the
        # blocks are real FSDP2 shard units
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = shardwise.initialize(model=make_model(), config=config)
    return engine


def _train(engine: Any, rank: int, gas: int, after_step: Any = None) -> list[float]:
    losses = []
    for step in range(STEPS):
        for micro in range(gas):
            x, y = batch(step, micro, rank, 2)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        if after_step is not None:
            after_step(step)
    return losses


def compiled_against_eager(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """The same 50 steps eager and with ``engine.compile(backend=CompileCounter over case["backend"])``:
    losses, and dynamo's counts (frames compiled after the first step and at the end, graph breaks)."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    stage, gas = case["stage"], case["gas"]
    eager = _train(_engine(stage, gas), rank, gas)

    torch._dynamo.reset()
    counters.clear()
    engine = _engine(stage, gas)
    backend = CompileCounterWithBackend(case["backend"])
    engine.compile(backend=backend)
    frames: dict[int, int] = {}
    compiled = _train(engine, rank, gas, after_step=lambda step: frames.setdefault(step, backend.frame_count))
    return {
        "eager": eager,
        "compiled": compiled,
        "is_compiled": engine.is_compiled,
        "targets": engine.compiler.plan.targets,
        "frames_after_warmup": frames[0],
        "frames_at_end": frames[STEPS - 1],
        "graph_breaks": sum(counters["graph_break"].values()),
        "ops_per_graph": backend.op_count / max(backend.frame_count, 1),
        "block_class": type(engine.module.blocks[0]).__name__,
    }
