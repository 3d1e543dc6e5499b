"""``expert_parallel.use_grouped_mm``: AutoEP's local experts as one ``torch._grouped_mm`` per projection
against the loop of one matrix product per expert (``use_grouped_mm: false``), and with the gate and up
projections as one grouped product (``gate_up_impl: "fused"``), forward and backward,
bf16, on this machine's CPU (where torch's grouped GEMM is itself a loop of per-group products, so
what it saves is the Python loop and the autograd nodes; on a Hopper GPU it is one fused kernel)::

    python benchmarks/grouped_experts_bench.py                  # Mixtral-like expert sizes
    python benchmarks/grouped_experts_bench.py --experts 32 --hidden 64 --ffn 128 --tokens 512

Prints the least time of ``--repeats`` rounds for each path (the two alternate, so load drifts hit
both) and grouped / loop as a ratio, and checks the two outputs and gradients are bit-identical.
"""

from __future__ import annotations

import argparse
import time

import torch

from shardwise.autoep.experts import GroupedExperts


def _experts(args: argparse.Namespace, grouped: bool) -> GroupedExperts:
    torch.manual_seed(0)
    experts = GroupedExperts(args.hidden, args.ffn, args.experts, use_grouped_mm=grouped)
    for weight in (experts.w1, experts.w2, experts.w3):
        torch.nn.init.normal_(weight, std=0.02)
    return experts.to(torch.bfloat16)


def _step(experts: GroupedExperts, x: torch.Tensor, counts: torch.Tensor) -> list[torch.Tensor]:
    x = x.detach().requires_grad_(True)
    out = experts(x, counts)
    out.float().square().mean().backward()
    grads = [x.grad, *(w.grad for w in (experts.w1, experts.w2, experts.w3))]
    experts.zero_grad(set_to_none=True)
    return [out.detach(), *grads]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, default=8, help="local experts")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=2048, help="routed rows")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(1)
    counts = torch.multinomial(torch.ones(args.experts), args.tokens, replacement=True, generator=generator)
    counts = torch.bincount(counts, minlength=args.experts)
    x = torch.randn(args.tokens, args.hidden, generator=generator).to(torch.bfloat16)
    paths = {"grouped_mm": _experts(args, True), "loop": _experts(args, False), "fused": _experts(args, True)}
    paths["fused"].fused_gate_up = True  # gate_up_impl="fused": gate and up as one grouped product
    results = {name: _step(experts, x, counts) for name, experts in paths.items()}
    identical = all(torch.equal(a, b) for a, b in zip(results["grouped_mm"], results["loop"], strict=True))
    fused_forward = torch.equal(results["fused"][0], results["grouped_mm"][0])
    best = dict.fromkeys(paths, float("inf"))
    for _ in range(args.repeats):
        for name, experts in paths.items():
            start = time.perf_counter()
            _step(experts, x, counts)
            best[name] = min(best[name], time.perf_counter() - start)
    print(f"{args.experts} local experts, {args.hidden}->{args.ffn}->{args.hidden}, {args.tokens} rows, bf16, "
          f"{torch.get_num_threads()} threads; kernels {paths['grouped_mm'].kernel} / {paths['loop'].kernel}")
    for name, seconds in best.items():
        print(f"  {name:10s} {seconds * 1e3:8.2f} ms (forward + backward, least of {args.repeats})")
    print(f"  grouped / loop: {best['grouped_mm'] / best['loop']:.2f}; bit-identical: {identical}")
    print(f"  fused / grouped: {best['fused'] / best['grouped_mm']:.2f}; same forward: {fused_forward}")


if __name__ == "__main__":
    main()
