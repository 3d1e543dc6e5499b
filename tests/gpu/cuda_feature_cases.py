"""Per-rank cases of test_cuda_features.py: activation checkpointing, checkpoints, sparse attention,
compression and data efficiency on one GPU.

Each reuses the CPU suite's case function (tests/distributed/*_cases.py, tests/unit/ops) on the rank's
device; :func:`run_case` dispatches on ``case["kind"]``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from cuda_support import device, to_cpu

_OPS_TESTS = str(Path(__file__).resolve().parents[1] / "unit" / "ops")


def activation_checkpointing(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """Plain vs checkpointed training of the dropout GPT (activation_checkpointing_cases.engine_case)."""
    import activation_checkpointing_cases

    out = activation_checkpointing_cases.engine_case(rank, world, case)
    out["device"] = str(device())
    return to_cpu(out)


def rng_tracker_fork(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """Dropout drawn inside ``get_cuda_rng_tracker().fork()`` (Megatron style): checkpointed (both
    modes) and plain give the same gradient and leave the tracked stream in the same state; the
    forked stream is not the default one (the masks differ)."""
    from torch.nn import functional as F

    from shardwise import checkpointing

    dev = device()
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 64).to(dev)

    def block(x: torch.Tensor) -> torch.Tensor:
        with checkpointing.get_cuda_rng_tracker().fork():
            return F.dropout(lin(x), p=0.5, training=True)

    def run(fn: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        checkpointing.configure(None)
        checkpointing.model_parallel_cuda_manual_seed(11)
        lin.zero_grad()
        x = torch.ones(8, 64, device=dev, requires_grad=True)
        out = fn(block, x) if fn else block(x)
        out.sum().backward()
        state = checkpointing.get_cuda_rng_tracker().get_states()["model-parallel-rng"]
        return lin.weight.grad.clone(), state, (out == 0)

    plain_grad, plain_state, plain_mask = run(None)
    results = {}
    for name, fn in (
        ("reentrant", checkpointing.checkpoint),
        ("non_reentrant", checkpointing.non_reentrant_checkpoint),
    ):
        grad, state, _ = run(fn)
        results[name] = {
            "grad_equal": torch.equal(grad, plain_grad),
            "state_equal": torch.equal(state, plain_state),
        }
    checkpointing.model_parallel_cuda_manual_seed(11)
    default_mask = F.dropout(lin(torch.ones(8, 64, device=dev)), p=0.5, training=True) == 0
    checkpointing.configure(None)
    return {
        "device": str(dev),
        "modes": results,
        "fork_differs_from_default": not torch.equal(plain_mask, default_mask),
        "dropped_fraction": float(plain_mask.float().mean()),
    }


def checkpoint_resume(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """Train 2N == train N, save, fresh engine, load, train N (checkpoint_cases.resume_is_bit_exact,
    dropout on); then the state at the save, for a load on the CPU (``cpu_view``)."""
    import checkpoint_cases

    out = checkpoint_cases.resume_is_bit_exact(rank, world, case)
    out["device"] = str(device())
    if case.get("cpu_view"):
        engine, _ = checkpoint_cases.build(case["stage"], world, case["precision"], seed=2, dropout=0.1)
        engine.load_checkpoint(case["dir"], tag="global_step4")
        out["loaded_params"] = to_cpu(checkpoint_cases.full_params(engine))
        out["loaded_state"] = to_cpu(checkpoint_cases.full_optimizer_state(engine))
        engine.destroy()
    return to_cpu(out)


def load_on_cpu(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """On the CPU (gloo): load the GPU-saved checkpoint, return the same views as :func:`checkpoint_resume`."""
    import checkpoint_cases

    engine, _ = checkpoint_cases.build(case["stage"], world, case["precision"], seed=2, dropout=0.1)
    engine.load_checkpoint(case["dir"], tag="global_step4")
    out = {
        "device": str(engine.device),
        "loaded_params": checkpoint_cases.full_params(engine),
        "loaded_state": checkpoint_cases.full_optimizer_state(engine),
    }
    engine.destroy()
    return out


def sparse_attention(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """SparseSelfAttention on the device against the dense masked reference on the device and against
    its own CPU result (test_sparse_self_attention's configs, inputs and reference), outputs and grads."""
    if _OPS_TESTS not in sys.path:
        sys.path.insert(0, _OPS_TESTS)
    import test_sparse_self_attention as unit

    from shardwise.ops.sparse_attention import SparseSelfAttention

    dev = device()
    out: dict[str, Any] = {"device": str(dev)}
    for name in case["configs"]:
        attn = SparseSelfAttention(unit.CONFIGS[name], max_seq_length=64)
        cpu_inputs = unit._inputs()
        dev_inputs = [t.detach().to(dev).requires_grad_() for t in cpu_inputs]
        mask = unit.element_mask(attn.get_layout(unit.SEQ), unit.BLOCK, attn.causal)
        on_dev = attn(*dev_inputs)
        dense = unit.dense_reference(*dev_inputs, mask.to(dev))
        on_cpu = attn(*cpu_inputs)

        def diff(a: Any, b: Any) -> float:
            return float((a.detach().cpu().double() - b.detach().cpu().double()).abs().max())

        grads_dev = unit._grads(on_dev, dev_inputs)
        grads_dense = unit._grads(dense, dev_inputs)
        grads_cpu = unit._grads(on_cpu, cpu_inputs)
        out[name] = {
            "output_device": on_dev.device.type,
            "vs_dense": max([diff(on_dev, dense)] + [diff(a, b) for a, b in zip(grads_dev, grads_dense)]),
            "vs_cpu": max([diff(on_dev, on_cpu)] + [diff(a, b) for a, b in zip(grads_dev, grads_cpu)]),
        }
    return out


def compression(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """Weight quantization and head pruning training on the device (compression_cases.run); and the
    quantizer on the device equals the CPU's bit for bit (max/min, a power-of-two or exact-difference
    scale, one IEEE division, round, clamp, one multiply, one add: each correctly rounded, unfused)."""
    import compression_cases

    from shardwise.compression.quantizers import quantize_values

    dev = device()
    out = compression_cases.run(rank, world, case["tmp"], case["stage"], case.get("bf16", False))
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(64, 48, generator=gen)
    equal = {}
    for bits in (8, 6, 4):
        for symmetric in (True, False):
            ours = quantize_values(w.to(dev), bits, 4, symmetric, False).cpu()
            cpu = quantize_values(w, bits, 4, symmetric, False)
            levels = max(len(row.unique()) for row in ours.reshape(4, -1))
            equal[f"{bits}-{'sym' if symmetric else 'asym'}"] = (torch.equal(ours, cpu), levels)
    out["quantizer_equal_to_cpu"] = equal
    out["device"] = str(dev)
    return to_cpu(out)


def curriculum_seqlen(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """Curriculum seqlen: the model gets the scheduled lengths (data_efficiency_cases)."""
    import data_efficiency_cases

    out = data_efficiency_cases.model_receives_the_scheduled_seqlen(rank, world, case)
    out["device"] = str(device())
    return to_cpu(out)


def curriculum_resume(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """Resume mid-curriculum (with random-LTD) equals an uninterrupted run (data_efficiency_cases)."""
    import data_efficiency_cases

    out = data_efficiency_cases.resume_mid_curriculum(rank, world, case)
    out["device"] = str(device())
    return to_cpu(out)


def cpu_tensor_collectives(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """shardwise.comm's collectives on CPU tensors (the checkpoint's sizes, digests and byte payloads)
    work on an NCCL group: staged through the GPU, the result back in the CPU tensor, sync and async."""
    import torch.distributed as dist

    from shardwise import comm

    summed = torch.tensor([3.0, 5.0])
    comm.all_reduce(summed, op="sum")
    averaged = torch.tensor([4.0, 8.0])
    comm.all_reduce(averaged, op="avg", async_op=True).wait()
    sent = torch.arange(6, dtype=torch.uint8)
    comm.broadcast(sent, src=0)
    gathered = torch.zeros(4 * world, dtype=torch.int64)
    comm.all_gather_flat(gathered, torch.arange(4, dtype=torch.int64) + 10 * rank)
    # the stage-2 reducer's reduce-scatter over uneven ranges, on the device (NCCL: an all-reduce of a
    # scratch copy; the rest of the buffer keeps its partial values)
    dev = device()
    ranged = torch.arange(10, dtype=torch.float32, device=dev)
    comm.reduce_scatter_ranges(ranged, [(3, 7)], async_op=True).wait()
    into = torch.zeros(4, device=dev)
    comm.reduce_scatter_ranges(ranged, [(3, 7)], out=into)
    # equal consecutive shards covering the buffer: NCCL's own reduce-scatter (in place, and into ``out``)
    whole = torch.arange(6, dtype=torch.float32, device=dev)
    comm.reduce_scatter_ranges(whole, [(0, 6)], async_op=True).wait()
    whole_out = torch.zeros(6, device=dev)
    comm.reduce_scatter_ranges(whole, [(0, 6)], out=whole_out)
    return {
        "ranged": (ranged.device.type, ranged.tolist(), into.tolist()),
        "whole": (whole.tolist(), whole_out.tolist()),
        "backend": str(dist.get_backend()),
        "summed": (summed.device.type, summed.tolist()),
        "averaged": (averaged.device.type, averaged.tolist()),
        "sent": (sent.device.type, sent.tolist()),
        "gathered": (gathered.device.type, gathered.tolist()),
    }


def rng_restore_on_another_layout(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """checkpoint.rng: a state saved where more GPUs were visible (here: a fake list of two, the
    saving rank on GPU 1) restores the saving rank's generator into this rank's GPU."""
    from shardwise.checkpoint import rng

    dev = device()
    if dev.type != "cuda":
        return {"device": str(dev)}
    torch.rand(1, device=dev)  # the CUDA generator is in use
    state = rng.capture()
    expected = torch.rand(4, device=dev).tolist()
    torch.cuda.manual_seed(12345)
    other = torch.cuda.get_rng_state()
    moved = {**state, "cuda": [other, state["cuda"][state["cuda_device"]]], "cuda_device": 1}
    rng.restore(moved)
    return {"device": str(dev), "equal": torch.rand(4, device=dev).tolist() == expected}


def grad_fold(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """The step divisor folded into torch's fused Adam/AdamW (``grad_scale``) equals the separate
    ``_foreach_div_`` bit for bit on the device too, subnormal and huge gradients included, for
    power-of-two and other fp32 divisors (test_grad_fold's cases, run on the device)."""
    unit_zero_tests = str(Path(__file__).resolve().parents[1] / "unit" / "zero")
    if unit_zero_tests not in sys.path:
        sys.path.insert(0, unit_zero_tests)
    import test_grad_fold as unit

    dev = str(device())
    out: dict[str, Any] = {"device": dev}
    for kind in (torch.optim.AdamW, torch.optim.Adam):
        for divisor in unit.DIVISORS:
            folded = unit._run(kind, True, divisor, device=dev, fused=True)
            divided = unit._run(kind, False, divisor, device=dev, fused=True)
            out[f"{kind.__name__}/{divisor!r}"] = all(torch.equal(a, b) for a, b in zip(folded, divided))
    return out


SCENARIOS = {
    "grad_fold": grad_fold,
    "rng_restore_on_another_layout": rng_restore_on_another_layout,
    "cpu_tensor_collectives": cpu_tensor_collectives,
    "activation_checkpointing": activation_checkpointing,
    "rng_tracker_fork": rng_tracker_fork,
    "checkpoint_resume": checkpoint_resume,
    "sparse_attention": sparse_attention,
    "compression": compression,
    "curriculum_seqlen": curriculum_seqlen,
    "curriculum_resume": curriculum_resume,
}


def run_case(rank: int, world: int, case: dict[str, Any]) -> Any:
    """Dispatch one case to its scenario."""
    return SCENARIOS[case["kind"]](rank, world, case)
