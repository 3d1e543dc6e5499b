"""A single-process reference for ZeRO parity tests, and the per-rank training function.

The reference is fed the same global batch as the ranks, processed as the same micro
batches (rank r's micro batch k of step s is forwarded on its own, as rank r does), so
every forward and backward runs the same kernels on the same shapes; gradients are
accumulated in fp32 per rank and summed over ranks in the same order as the reduction.
It implements DeepSpeed's recipe directly with plain torch: 16-bit model copy for
forward/backward, fp32 master weights, loss / GAS (x loss scale for fp16), mean over
ranks, global-norm clipping, AdamW on the masters.

Clipping. The multiplier depends on the global gradient norm, and the engine sums that
norm shard by shard (bucket shards at stages 1-2, FSDP2 row shards at stage 3, then an
all-reduce) while a single process sums it tensor by tensor: the two fp32 sums round
differently, and by how much depends on the CPU's vector width (AVX2 vs AVX-512 vs the
``default`` kernels). So the two halves are checked separately:

- the parameters are exact by construction: given ``engine_norms`` (the norms the engine
  reported), the reference derives the divisor from the engine's norm with DeepSpeed's
  rule (``combined = loss_scale * max(1, (norm + 1e-6) / clip)``, rounded to fp32, grads
  ``/= combined``), so every later operation runs the same kernels on the same bits;
- the norm itself is compared with the exact (float64) norm of the reference's fp32
  gradients within :func:`norm_error_bound`, a worst-case bound on fp32 rounding that
  holds for any summation order, hence on any CPU.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from shardwise.testing.models import GPTConfig, TinyGPT
from shardwise.zero.step_math import fp32

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TINY = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, qkv_bias=False)
LR, BETAS, EPS, WD = 1e-2, (0.9, 0.99), 1e-8, 0.01


def make_model(seed: int = 0) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(TINY)


def batch(step: int, micro: int, rank: int, micro_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The deterministic micro batch that ``rank`` sees at (step, micro)."""
    gen = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    data = torch.randint(0, TINY.vocab_size, (micro_batch, TINY.block_size + 1), generator=gen)
    return data[:, :-1], data[:, 1:]


def train_step(engine: Any, step: int, rank: int, gas: int, micro_batch: int = 2) -> list[float]:
    """One optimizer step of ``engine`` on ``rank``'s micro batches (DeepSpeed's loop: forward,
    backward, step per micro batch); the micro batches' losses."""
    import torch.nn.functional as F

    losses = []
    for micro in range(gas):
        x, y = batch(step, micro, rank, micro_batch)
        logits = engine(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


def config(
    stage: int, precision: str, gas: int, micro_batch: int, world: int, clip: float = 0.0, **zero: Any
) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD},
        },
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 3000, **zero},
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 1000}
    return cfg


def reference_run(
    precision: str,
    gas: int,
    micro_batch: int,
    world: int,
    steps: int,
    *,
    reduce_every_micro: bool = False,
    clip: float = 0.0,
    engine_norms: list[float] | None = None,
    device: str | torch.device = "cpu",
    opt_device: str | torch.device | None = None,
    align_like: list[int] | None = None,
) -> dict[str, Any]:
    """Losses per (step, micro, rank), gradient norms per step and final fp32 master parameters.

    ``norms`` are exact: float64 sums of the reference's fp32 gradients. ``largest_tensor``
    is the largest gradient's element count (for :func:`norm_error_bound`). With
    ``engine_norms`` (one per step) the clipping multiplier is computed from those instead
    of the reference's own norms (see the module docstring).

    ``device`` runs the model there (the GPU tests: the same kernels as the engine on the same
    GPU); ``opt_device`` (default: ``device``) holds the fp32 masters and runs AdamW there, as
    optimizer offload does (gradients copied to it, the updated masters copied back). Results
    come back on the CPU. ``align_like`` (the engine's parameters' addresses modulo 256 bytes, in
    ``parameters()`` order) puts each reference parameter at the same alignment: cuBLAS may pick its
    algorithm by the operands' alignment, and the engine's parameters are views into flat buffers.

    ``reduce_every_micro`` sums over ranks after every micro batch and accumulates those
    sums (ZeRO-2's order); otherwise each rank accumulates its micro batches and the
    per-rank sums are added (stages 0/1). Both are the same mean, rounded differently.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks use 1 thread: reductions split the same way
    try:
        return _reference(
            precision,
            gas,
            micro_batch,
            world,
            steps,
            reduce_every_micro,
            clip,
            engine_norms,
            torch.device(device),
            torch.device(opt_device if opt_device is not None else device),
            align_like,
        )
    finally:
        torch.set_num_threads(threads)


def _reference(
    precision: str,
    gas: int,
    micro_batch: int,
    world: int,
    steps: int,
    reduce_every_micro: bool,
    clip_to: float,
    engine_norms: list[float] | None,
    device: torch.device,
    opt_device: torch.device,
    align_like: list[int] | None,
) -> dict[str, Any]:
    dtype = DTYPES[precision]
    model = make_model()
    params = list(model.parameters())
    model.to(dtype)  # like the engine: masters start from the 16-bit values
    model.to(device)
    if align_like is not None:
        _align(params, align_like)
    masters = [p.detach().float().to(opt_device, copy=True) for p in params]
    opt = torch.optim.AdamW(masters, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)
    scale = 2.0**8 if precision == "fp16" else 1.0
    losses: dict[tuple[int, int, int], float] = {}
    norms = []
    for step in range(steps):
        grads: dict[tuple[int, int], list[torch.Tensor]] = {}
        for rank in range(world):
            for micro in range(gas):
                x, y = batch(step, micro, rank, micro_batch)
                loss = model(x.to(device), y.to(device))
                losses[(step, micro, rank)] = loss.item()
                scaled = (loss / gas if gas > 1 else loss).float() * scale
                scaled.backward()
                grads[(micro, rank)] = [p.grad.float().to(opt_device) for p in params]
                for p in params:
                    p.grad = None
        total = [torch.zeros_like(m) for m in masters]
        if reduce_every_micro:
            for micro in range(gas):
                for i, t in enumerate(total):
                    summed = grads[(micro, 0)][i].clone()
                    for rank in range(1, world):
                        summed.add_(grads[(micro, rank)][i])
                    t.add_(summed)
        else:
            for i in range(len(total)):
                per_rank = []
                for rank in range(world):
                    acc = torch.zeros_like(masters[i])
                    for micro in range(gas):
                        acc.add_(grads[(micro, rank)][i])
                    per_rank.append(acc)
                total[i] = per_rank[0].clone()
                for rank in range(1, world):
                    total[i].add_(per_rank[rank])
        divisor = world * scale  # a power of two: norm * divisor below is exact
        norm = math.sqrt(sum(float(t.double().square().sum()) for t in total)) / divisor
        norms.append(norm)
        used = norm if engine_norms is None else engine_norms[step]
        combined = divisor
        clip = (used + 1e-6) / clip_to if clip_to > 0 else 0.0
        if clip > 1:
            combined = divisor * clip
        combined = fp32(combined)
        for m, t in zip(masters, total):
            m.grad = t / combined
        opt.step()
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)
    largest = max(m.numel() for m in masters)
    return {
        "losses": losses,
        "params": [m.cpu().clone() for m in masters],
        "norms": norms,
        "largest_tensor": largest,
    }


def _align(params: list[torch.Tensor], offsets: list[int]) -> None:
    """Move each parameter's data to an address with the given remainder modulo 256 bytes."""
    assert len(params) == len(offsets), (len(params), len(offsets))
    for p, offset in zip(params, offsets):
        size = p.element_size()
        buffer = torch.empty(p.numel() + 256 // size, dtype=p.dtype, device=p.device)
        start = ((offset - buffer.data_ptr()) % 256) // size
        view = buffer[start : start + p.numel()].view_as(p)
        view.copy_(p.detach())
        p.data = view
        assert p.data_ptr() % 256 == offset, (p.data_ptr() % 256, offset)


def norm_error_bound(norm: float, largest_tensor: int, tensors: int, world: int) -> float:
    """Worst-case |fp32 norm - exact norm| for a global L2 norm computed the engine's way.

    The engine squares every element in fp32 (one rounding each), sums the squares within
    each gradient tensor or shard (at most ``largest_tensor`` addends), combines at most
    ``tensors`` per-tensor partial sums on each rank (going through a per-tensor norm, i.e.
    a square root and a square: two more roundings) and adds the ``world`` ranks' sums.
    (A bucket shard at stages 1-2 holds at most half a 3000-element bucket here, fewer than
    the largest parameter's 4096 elements, so ``largest_tensor`` bounds every chain.)
    Every addend is non-negative, so whatever the order or grouping (sequential, vectorised
    lanes of any width, pairwise), the computed sum of squares is within
    ``gamma(k) = k*u / (1 - k*u)`` relative of the exact one, ``u = 2**-24``, with ``k`` the
    longest chain of roundings any term goes through:
    ``k = 1 + largest_tensor + 2 + tensors + world`` (Higham, *Accuracy and Stability of
    Numerical Algorithms*, 2nd ed., eq. 4.4). The square root halves a relative error and
    adds one rounding: ``|norm~ - norm| <= (gamma(k) / 2 + u) * norm``.

    Example:
        >>> round(norm_error_bound(1.0, 4096, 30, 2) * 1e4, 3)  # about 1.2e-4 relative
        1.232
    """
    u = 2.0**-24
    k = 1 + largest_tensor + 2 + tensors + world
    gamma = k * u / (1 - k * u)
    return (gamma / 2 + u) * norm


def rank_train(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """One rank of the engine under test (run by the harness)."""
    import shardwise

    torch.set_num_threads(1)
    model = make_model()
    engine, _, _, _ = shardwise.initialize(
        model=model,
        model_parameters=model.parameters(),
        config=config(
            case["stage"],
            case["precision"],
            case["gas"],
            case["micro_batch"],
            world,
            clip=case.get("clip", 0.0),
            **case.get("zero", {}),
        ),
    )
    losses = {}
    norms = []
    for step in range(case["steps"]):
        for micro in range(case["gas"]):
            x, y = _micro_batch(case, step, micro, rank)
            loss = engine(x.to(engine.device), y.to(engine.device))
            losses[(step, micro, rank)] = loss.item()
            engine.backward(loss)
            engine.step()
        norms.append(engine.get_global_grad_norm())
    masters = _full_masters(engine)
    return {
        "losses": losses,
        "params": masters,
        "steps": engine.global_steps,
        "skipped": engine.skipped_steps,
        "state_bytes": engine.optimizer.model_state_bytes(),
        "norms": norms,
        "param_alignment": [p.data_ptr() % 256 for p in engine.module.parameters()],
    }


def _micro_batch(case: dict[str, Any], step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """With ``same_data`` every accumulation split of a step sees the same samples."""
    m = case["micro_batch"]
    if not case.get("same_data"):
        return batch(step, micro, rank, m)
    x, y = batch(step, 0, rank, m * case["gas"])
    return x[micro * m : (micro + 1) * m], y[micro * m : (micro + 1) * m]


def _full_masters(engine: Any) -> list[torch.Tensor]:
    """Full fp32 parameter values in model order (16-bit params: gather fp32 masters)."""
    import torch.distributed as dist

    opt = engine.optimizer
    out: list[torch.Tensor] = []
    by_param: dict[int, torch.Tensor] = {}
    for flat in opt.groups:
        full = flat.local_master_flat()
        if flat.shard and dist.get_world_size() > 1:
            dist.all_reduce(full)  # owned ranges are disjoint across ranks
        for index, p in enumerate(flat.params):
            a, b = flat.param_view(index)
            by_param[id(p)] = full[a:b].view_as(p).clone()
    for p in engine.module.parameters():
        out.append(by_param[id(p)].cpu())
    return out
