"""Where inductor's losses part from eager's: one transformer block of the compile benchmark's GPT
(``compile_bench.py --model``), forward and backward, eager fp32 against inductor fp32, eager fp32 with
``ATEN_CPU_CAPABILITY=avx2`` (a subprocess: ATen's kernels in 8 lanes, another summation order) and
an fp64 run of the same block::

    python benchmarks/compile_block_rounding.py              # the 17m GPT's block
    python benchmarks/compile_block_rounding.py --model quick

Prints, per output and parameter gradient, how many elements differ from eager and by how many ulps
(median, 99th percentile), then the L2 of every run's parameter-gradient difference from eager and from
fp64 (the rounding error each run makes), then the same for single ops (layer norm, GELU, attention,
linear): which ops inductor runs as its own kernels (they differ) and which stay ATen's (bit for bit).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile

import torch
import torch.nn.functional as F

from shardwise.testing.models import Block, GPTConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compile_bench import MODELS


def _block(model: str) -> tuple[Block, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    cfg = GPTConfig(**MODELS[model], qkv_bias=False)
    x, gy = torch.randn(2, 32, cfg.n_embd), torch.randn(2, 32, cfg.n_embd)
    return Block(cfg), x, gy


def _run(block: Block, x: torch.Tensor, gy: torch.Tensor, dtype: torch.dtype = torch.float32, compiled: bool = False) -> dict:
    block = copy.deepcopy(block).to(dtype)
    if compiled:  # as engine.compile() does: the block's forward under torch.compile, the module kept
        block.forward = torch.compile(block.forward, backend="inductor")
    xx = x.to(dtype).clone().requires_grad_(True)
    y = block(xx)
    y.backward(gy.to(dtype))
    out = {"out": y.detach(), "grad x": xx.grad}
    out.update({f"grad {n}": p.grad for n, p in block.named_parameters()})
    return out


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in fp32 representable numbers, where both have the same sign."""
    same = (a.sign() == b.sign()) | (a == 0) | (b == 0)
    return (a.view(torch.int32).long() - b.view(torch.int32).long()).abs()[same].double()


def _line(name: str, eager: torch.Tensor, other: torch.Tensor) -> str:
    u = _ulps(eager.contiguous(), other.contiguous())
    return (f"{name:24s} differing {(eager != other).float().mean().item():6.3f}  ulps median "
            f"{u.median().item():3.0f} p99 {u.quantile(0.99).item():5.0f}  max |diff| "
            f"{(eager - other).abs().max().item():.3g}")  # fmt: skip


def _l2(a: dict, b: dict) -> float:
    keys = [k for k in a if k.startswith("grad ") and k != "grad x"]
    return float(sum(((a[k].double() - b[k].double()) ** 2).sum() for k in keys).sqrt())


def _ops() -> None:
    print("single ops (forward, then the gradient of the first input):")
    cases = {
        "layer_norm": (lambda t: F.layer_norm(t, (384,)), [(2, 32, 384)]),
        "gelu": (F.gelu, [(2, 32, 1536)]),
        "sdpa (causal)": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), [(2, 6, 32, 64)] * 3),
        "linear": (F.linear, [(64, 384), (1536, 384), (1536,)]),
    }  # fmt: skip
    for name, (fn, shapes) in cases.items():
        inputs = [torch.randn(*s) for s in shapes]
        results = []
        for f in (fn, torch.compile(fn, backend="inductor")):
            args = [t.clone().requires_grad_(True) for t in inputs]
            out = f(*args)
            out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)))
            results.append((out.detach(), args[0].grad))
        print("  " + _line(f"{name} fwd", results[0][0], results[1][0]))
        print("  " + _line(f"{name} bwd", results[0][1], results[1][1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="17m")
    parser.add_argument("--save", help=argparse.SUPPRESS)  # the avx2 subprocess: write eager's results here
    args = parser.parse_args()
    torch.set_num_threads(1)
    block, x, gy = _block(args.model)
    if args.save:
        torch.save(_run(block, x, gy), args.save)
        return
    eager, fp64 = _run(block, x, gy), _run(block, x, gy, torch.float64)
    inductor = _run(block, x, gy, compiled=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "avx2.pt")
        env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2", OMP_NUM_THREADS="1")
        subprocess.run([sys.executable, __file__, "--model", args.model, "--save", path], env=env, check=True)
        avx2 = torch.load(path)
    print(f"one block of the {args.model} GPT {json.dumps(MODELS[args.model])}, batch 2 x 32")
    for label, other in (("inductor", inductor), ("eager ATEN_CPU_CAPABILITY=avx2", avx2)):
        print(f"{label} against eager:")
        for key in eager:
            print("  " + _line(key, eager[key], other[key]))
    print("parameter gradients, L2 of the difference:")
    for label, run in (("eager", eager), ("inductor", inductor), ("eager avx2", avx2)):
        print(f"  {label:12s} from eager {_l2(run, eager):.3g}  from fp64 {_l2(run, fp64):.3g}")
    print(f"  inductor / avx2 perturbation: {_l2(inductor, eager) / _l2(avx2, eager):.2f}")
    _ops()


if __name__ == "__main__":
    main()
