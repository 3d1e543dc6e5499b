"""``use_grouped_mm``: AutoEP's experts as one ``torch._grouped_mm`` per projection, against the loop."""

from __future__ import annotations

import pytest
import torch

from shardwise.autoep.experts import GroupedExperts, grouped_mm_applies


def _experts(dtype: torch.dtype, use_grouped_mm: bool, hidden: int = 16, ffn: int = 32) -> GroupedExperts:
    torch.manual_seed(0)
    experts = GroupedExperts(hidden, ffn, 4, use_grouped_mm=use_grouped_mm)
    for weight in (experts.w1, experts.w2, experts.w3):
        torch.nn.init.normal_(weight, std=0.2)
    return experts.to(dtype)


def _run(experts: GroupedExperts, x: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x = x.clone().requires_grad_(True)
    out = experts(x, counts)
    grad_out = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    grads = torch.autograd.grad(out, (x, experts.w1, experts.w2, experts.w3), grad_out)
    return (out.detach(), *grads)


@pytest.mark.parametrize("counts", [[5, 0, 9, 2], [0, 0, 0, 0], [16, 0, 0, 0]])
def test_grouped_mm_matches_the_loop_bitwise_in_bf16(counts: list[int]) -> None:
    counts_t = torch.tensor(counts)
    x = torch.randn(sum(counts), 16, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    grouped, loop = _experts(torch.bfloat16, True), _experts(torch.bfloat16, False)
    got, want = _run(grouped, x, counts_t), _run(loop, x, counts_t)
    assert (grouped.kernel, loop.kernel) == ("grouped_mm", "loop")
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)  # torch's CPU grouped GEMM is the same per-group products


def test_grouped_mm_runs_only_where_torch_takes_it() -> None:
    bf16 = torch.zeros(1, 16, dtype=torch.bfloat16)
    assert grouped_mm_applies(bf16, torch.zeros(4, 32, 16, dtype=torch.bfloat16))
    assert not grouped_mm_applies(bf16, torch.zeros(4, 30, 16, dtype=torch.bfloat16))  # 60-byte rows
    assert not grouped_mm_applies(bf16.float(), torch.zeros(4, 32, 16))  # fp32: torch's op takes bf16
    fp32 = _experts(torch.float32, True)
    fp32(torch.randn(3, 16), torch.tensor([1, 1, 1, 0]))
    assert fp32.kernel == "loop"


def test_counts_must_cover_the_rows() -> None:
    with pytest.raises(ValueError, match="counts sum to 3 rows but x has 4"):
        _experts(torch.bfloat16, True)(torch.zeros(4, 16, dtype=torch.bfloat16), torch.tensor([1, 1, 1, 0]))
