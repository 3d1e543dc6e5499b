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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])  # the grouped kernel, then the loop
def test_fused_gate_up_forward_equals_separate_and_gradients_agree(dtype: torch.dtype) -> None:
    counts = torch.tensor([5, 0, 9, 2])
    x = torch.randn(16, 16, generator=torch.Generator().manual_seed(1)).to(dtype)
    fused = GroupedExperts(16, 32, 4, gate_up_impl="fused")
    separate = GroupedExperts(16, 32, 4)
    for weight in (separate.w1, separate.w2, separate.w3):
        torch.nn.init.normal_(weight, std=0.2, generator=torch.Generator().manual_seed(2))
    fused.load_state_dict(separate.state_dict())  # same parameters: w1 and w3 stay separate
    fused, separate = fused.to(dtype), separate.to(dtype)
    got, want = _run(fused, x, counts), _run(separate, x, counts)
    assert torch.equal(got[0], want[0])  # each output column is the same dot product
    # the input gradient adds the gate's and the up projection's parts inside one GEMM (one rounding
    # instead of two): within one rounding of the gradient's magnitude in the dtype
    eps = torch.finfo(dtype).eps
    for a, b in zip(got[1:], want[1:], strict=True):
        assert (a.float() - b.float()).abs().max() <= 4 * eps * b.float().abs().max()


def test_fused_gate_up_needs_grouped_mm() -> None:
    from shardwise.autoep.config import AutoEPConfig, validate_autoep_config

    def validate(**keys: object) -> None:
        validate_autoep_config(AutoEPConfig(enabled=True, **keys), world_size=1, pp_size=1, tp_size=1, sp_size=1)

    with pytest.raises(ValueError, match=r"gate_up_impl = 'fused'.*use_grouped_mm to true"):
        validate(gate_up_impl="fused", use_grouped_mm=False)
    with pytest.raises(ValueError, match=r"gate_up_impl = 'packed'.*one of"):
        validate(gate_up_impl="packed")
    validate(gate_up_impl="fused")
