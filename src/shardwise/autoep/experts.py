"""This rank's experts of an AutoEP layer, as three stacked weights: ``w1`` (gate projection,
``[E, F, H]``), ``w2`` (down projection, ``[E, H, F]``), ``w3`` (up projection, ``[E, F, H]``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from shardwise.utils.logging import logger

ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "swiglu": nn.functional.silu,
    "geglu": nn.functional.gelu,
}
"""``expert_activation`` name -> the function on the gate projection (``act(x w1^T) * (x w3^T)``)."""

GATE_UP_IMPLS = ("separate", "fused")
"""``gate_up_impl`` values: the gate and up projections as two products, or as one (see GroupedExperts)."""


class GroupedExperts(nn.Module):
    """``num_experts`` gated MLPs: ``forward(x [N, H], counts [E]) -> [N, H]``, where ``x`` holds the
    rows of expert 0, then expert 1... (``counts[e]`` rows each).

    ``use_grouped_mm=True`` (DeepSpeed's default) runs each projection of every expert as one
    ``torch._grouped_mm`` over row offsets: one kernel per projection on GPUs that have the fused one
    (Hopper), and one autograd node instead of ``E`` on any device. torch's grouped GEMM takes bf16
    inputs with 16-byte aligned rows (its meta check, so ``torch.compile`` too), so other dtypes or
    sizes, and torch builds without the op, run the loop: one matrix product per projection and
    expert. Both give bit-identical results where both run (the CPU kernel is the same per-group
    products). :attr:`kernel` says which ran last; the first forward logs it.

    ``gate_up_impl="fused"`` computes the gate and up projections as one product against ``w1`` and
    ``w3`` concatenated (rebuilt each call; the parameters keep their layout, so checkpoints do not
    change): one GEMM of ``2F`` columns forward, and one input-gradient GEMM backward that adds both
    projections' contributions before rounding. The forward is bit-identical to ``"separate"``; the
    input gradient differs by that rounding.
    """

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, use_grouped_mm: bool = True,
                 activation: str = "swiglu", gate_up_impl: str = "separate", **_: object) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"expert_activation = {activation!r}: one of {sorted(ACTIVATIONS)}; fix: choose one")
        if gate_up_impl not in GATE_UP_IMPLS:
            raise ValueError(f"gate_up_impl = {gate_up_impl!r}: one of {list(GATE_UP_IMPLS)}; fix: choose one")
        self.fused_gate_up = gate_up_impl == "fused"
        self.num_experts, self.use_grouped_mm, self.activation = num_experts, use_grouped_mm, activation
        self.kernel: str | None = None
        """``"grouped_mm"`` or ``"loop"``: how the last forward ran (None before the first)."""
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))

    def forward(self, x: Tensor, num_tokens_per_expert: Tensor) -> Tensor:
        """Expert ``e`` on its run of rows (``counts`` must sum to the rows of ``x``)."""
        kernel = "grouped_mm" if self.use_grouped_mm and grouped_mm_applies(x, self.w1) else "loop"
        if kernel != self.kernel:
            logger.info("AutoEP experts (%s, %d local): %s", x.dtype, self.num_experts, _KERNEL_WHY[kernel]
                        if self.use_grouped_mm else "use_grouped_mm=false: one matrix product per expert")
            self.kernel = kernel
        if kernel == "grouped_mm":
            return self._grouped(x, num_tokens_per_expert)
        return self._loop(x, num_tokens_per_expert)

    def _grouped(self, x: Tensor, counts: Tensor) -> Tensor:
        if counts.device.type == "cpu" and int(counts.sum()) != x.shape[0]:
            raise ValueError(f"GroupedExperts: counts sum to {int(counts.sum())} rows but x has {x.shape[0]}")
        offs = torch.cumsum(counts.to(x.device), 0, dtype=torch.int32)
        if self.fused_gate_up:
            gate_up = torch._grouped_mm(x, torch.cat([self.w1, self.w3], dim=1).transpose(-2, -1), offs=offs)
            gate, up = gate_up.chunk(2, dim=-1)
        else:
            gate = torch._grouped_mm(x, self.w1.transpose(-2, -1), offs=offs)
            up = torch._grouped_mm(x, self.w3.transpose(-2, -1), offs=offs)
        return torch._grouped_mm(ACTIVATIONS[self.activation](gate) * up, self.w2.transpose(-2, -1), offs=offs)

    def _loop(self, x: Tensor, num_tokens_per_expert: Tensor) -> Tensor:
        act = ACTIVATIONS[self.activation]
        outputs = []
        start = 0
        for e, count in enumerate(num_tokens_per_expert.tolist()):
            rows = x[start:start + count]
            start += count
            if self.fused_gate_up:
                gate, up = nn.functional.linear(rows, torch.cat([self.w1[e], self.w3[e]])).chunk(2, dim=-1)
            else:
                gate, up = nn.functional.linear(rows, self.w1[e]), nn.functional.linear(rows, self.w3[e])
            hidden = act(gate) * up
            outputs.append(nn.functional.linear(hidden, self.w2[e]))
        if start != x.shape[0]:
            raise ValueError(f"GroupedExperts: counts sum to {start} rows but x has {x.shape[0]}")
        return torch.cat(outputs) if outputs else x.new_zeros(0, x.shape[-1])


_KERNEL_WHY = {
    "grouped_mm": "one torch._grouped_mm per projection (use_grouped_mm)",
    "loop": "one matrix product per expert: torch's grouped GEMM needs bf16 inputs with rows a multiple of "
            "16 bytes (and a torch that has it)",
}


def grouped_mm_applies(x: Tensor, weight: Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes these experts' products: the op exists, inputs and weights
    are bf16, and the hidden and FFN sizes give 16-byte aligned rows (``weight``: ``w1``, ``[E, F, H]``)."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        return False
    per_row = 16 // x.element_size()
    return weight.shape[-1] % per_row == 0 and weight.shape[-2] % per_row == 0
