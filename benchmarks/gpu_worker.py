"""One GPU benchmark case: train a GPT for a few steps with one framework and print a JSON line.

Run by ``gpu_bench.py`` as a world-of-one job (``RANK``/``WORLD_SIZE``/``MASTER_*`` set by the
driver). The framework is one of

- ``shardwise``: ``shardwise.initialize`` with a DeepSpeed config (ZeRO stage 2 or 3, optionally
  ``offload_optimizer``/``offload_param`` to the CPU), bf16;
- ``fsdp2``: ``fully_shard`` on every block and the root, bf16 parameters with fp32 reduction,
  ``reshard_after_forward`` False for the stage-2 row and True for stage 3, ``CPUOffloadPolicy`` for
  the offload rows (it offloads parameters, gradients and the optimizer step together), fused AdamW;
- ``deepspeed``: real DeepSpeed with the same config as shardwise (its own interpreter path; this file
  imports nothing from shardwise so it also runs there).

It loads ``shardwise/testing/models.py`` by file path (``bench_models.load_models``), builds the model
directly on the GPU in fp32 (``torch.device`` as the default device: no host copy of a billion
parameters), and times ``--steps`` optimizer steps after ``--warmup``, each between two
``torch.cuda.synchronize()``. Printed: median step time, tokens/s, model TFLOP/s and MFU against the
given peak, peak GPU memory (``torch.cuda.max_memory_allocated`` and ``max_memory_reserved``), peak host
RSS, and the losses.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_models import load_models  # noqa: E402

# name: (n_layer, n_embd, n_head); vocab 50304, context from --seq
SIZES = {
    "tiny": (2, 128, 4),
    "125m": (12, 768, 12),
    "350m": (24, 1024, 16),
    "1.3b": (24, 2048, 16),
    "2.7b": (32, 2560, 32),
    "4b": (36, 3072, 24),
    "6.7b": (32, 4096, 32),
    "8b": (40, 4096, 32),
    "13b": (40, 5120, 40),
}
VOCAB = 50304


def ds_config(mode: str, micro_batch: int, *, torch_adam: bool) -> dict:
    """The DeepSpeed config of a row, the same file for shardwise and DeepSpeed."""
    zero: dict = {"stage": 2 if mode == "z2" else 3}
    if mode == "z2":
        zero.update(overlap_comm=True, contiguous_gradients=True)
    if mode in ("z3off", "z3offp"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if mode == "z3offp":
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    params: dict = {"lr": 1e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}
    if torch_adam:
        params["torch_adam"] = True
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 1_000_000,
        "optimizer": {"type": "AdamW", "params": params},
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": zero,
        "wall_clock_breakdown": False,
    }


def flops_per_token(n_params_matmul: int, n_layer: int, n_embd: int, seq: int) -> float:
    """Training FLOPs per token: 6 N (every weight matrix, the tied LM head included) plus the
    attention scores and their use, 12 L d T (PaLM's appendix B, full not causal)."""
    return 6.0 * n_params_matmul + 12.0 * n_layer * n_embd * seq


def build_model(models, size: str, seq: int, device):
    import torch

    n_layer, n_embd, n_head = SIZES[size]
    cfg = models.GPTConfig(vocab_size=VOCAB, block_size=seq, n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                           qkv_bias=False)  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = models.TinyGPT(cfg)
    n_total = sum(p.numel() for p in model.parameters())
    n_matmul = n_total - model.wpe.weight.numel()  # the position table is a lookup, no matmul
    return model, cfg, n_total, n_matmul


def run(args: argparse.Namespace) -> dict:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    models = load_models(str(HERE.parent / "src" / "shardwise" / "testing" / "models.py"))
    on_gpu = args.device == "cuda"
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)

    def sync() -> None:
        if on_gpu:
            torch.cuda.synchronize()
    init_start = time.perf_counter()
    model, cfg, n_total, n_matmul = build_model(models, args.size, args.seq, device)
    config = ds_config(args.mode, args.micro_batch, torch_adam=args.torch_adam)
    if args.framework == "shardwise":
        import shardwise

        engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=config)
        step = engine_step(engine)
    elif args.framework == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend="nccl" if on_gpu else "gloo")
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        step = engine_step(engine)
    elif args.framework == "fsdp2":
        step = fsdp2_step(model, args.mode, device)
    else:
        raise SystemExit(f"unknown framework {args.framework!r}")
    init_s = time.perf_counter() - init_start
    gen = torch.Generator(device=device).manual_seed(1)
    batches = [torch.randint(0, VOCAB, (args.micro_batch, args.seq + 1), device=device, generator=gen)
               for _ in range(4)]  # fmt: skip
    times, losses = [], []
    for i in range(args.warmup + args.steps):
        tokens = batches[i % len(batches)]
        sync()
        start = time.perf_counter()
        loss = step(tokens[:, :-1], tokens[:, 1:])
        sync()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
        losses.append(float(loss.detach().float().item()))
    step_s = statistics.median(times)
    tokens_per_step = args.micro_batch * args.seq
    tflops = flops_per_token(n_matmul, cfg.n_layer, cfg.n_embd, args.seq) * tokens_per_step / step_s / 1e12
    return {
        "framework": args.framework,
        "mode": args.mode,
        "size": args.size,
        "params": n_total,
        "micro_batch": args.micro_batch,
        "seq": args.seq,
        "init_s": round(init_s, 2),
        "step_s": step_s,
        "step_s_all": times,
        "tokens_per_s": tokens_per_step / step_s,
        "tflops": tflops,
        "mfu": tflops / args.peak_tflops,
        "peak_gpu_alloc_gib": torch.cuda.max_memory_allocated(device) / 2**30 if on_gpu else 0.0,
        "peak_gpu_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30 if on_gpu else 0.0,
        "peak_host_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "losses": losses,
        "torch_adam": args.torch_adam,
    }


def engine_step(engine):
    """One training step of a DeepSpeed-style engine (shardwise's or DeepSpeed's)."""

    def step(x, y):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss

    return step


def fsdp2_step(model, mode: str, device):
    """FSDP2 as its users write it: one ``fully_shard`` per block and one on the root."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    if not dist.is_initialized():
        if device.type == "cuda":
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if mode in ("z3off", "z3offp") else None
    kwargs = {"mp_policy": mp, "reshard_after_forward": mode != "z2"}
    if offload is not None:
        kwargs["offload_policy"] = offload
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    # fused AdamW on the GPU; on the host (CPU offload) torch's fused CPU kernel
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)

    def step(x, y):
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--framework", required=True, choices=["shardwise", "fsdp2", "deepspeed"])
    parser.add_argument("--mode", required=True, choices=["z2", "z3", "z3off", "z3offp"])
    parser.add_argument("--size", default="1.3b", choices=sorted(SIZES))
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--peak-tflops", type=float, default=989.4, help="the GPU's dense bf16 peak")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--torch-adam", action="store_true", help="DeepSpeed: torch's AdamW (its ops did not build)")
    args = parser.parse_args()
    try:
        result = run(args)
    except Exception as error:  # the driver reports the case as failed with this line
        traceback.print_exc()
        name = type(error).__name__
        oom = "out of memory" in str(error).lower() or name == "OutOfMemoryError"
        print(json.dumps({"error": f"{name}: {str(error)[:300]}", "oom": oom}), flush=True)
        os._exit(1)
    print(json.dumps(result), flush=True)
    os._exit(0)  # skip the frameworks' teardown (process-group destruction can take seconds)


if __name__ == "__main__":
    main()
