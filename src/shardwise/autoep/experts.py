"""This rank's experts of an AutoEP layer, as three stacked weights: ``w1`` (gate projection,
``[E, F, H]``), ``w2`` (down projection, ``[E, H, F]``), ``w3`` (up projection, ``[E, F, H]``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "swiglu": nn.functional.silu,
    "geglu": nn.functional.gelu,
}
"""``expert_activation`` name -> the function on the gate projection (``act(x w1^T) * (x w3^T)``)."""


class GroupedExperts(nn.Module):
    """``num_experts`` gated MLPs: ``forward(x [N, H], counts [E]) -> [N, H]``, where ``x`` holds the
    rows of expert 0, then expert 1... (``counts[e]`` rows each).

    The experts run one after another, one matrix product per projection and expert, on whatever
    device holds the weights. ``use_grouped_mm`` is accepted for DeepSpeed's configs; grouped
    (single-kernel) matrix products are not implemented, so both values compute the same loop.
    """

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, use_grouped_mm: bool = True,
                 activation: str = "swiglu", **_: object) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"expert_activation = {activation!r}: one of {sorted(ACTIVATIONS)}; fix: choose one")
        self.num_experts, self.use_grouped_mm, self.activation = num_experts, use_grouped_mm, activation
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))

    def forward(self, x: Tensor, num_tokens_per_expert: Tensor) -> Tensor:
        """Expert ``e`` on its run of rows; rows past ``sum(counts)`` (none here) stay zero."""
        act = ACTIVATIONS[self.activation]
        outputs = []
        start = 0
        for e, count in enumerate(num_tokens_per_expert.tolist()):
            rows = x[start:start + count]
            start += count
            hidden = act(nn.functional.linear(rows, self.w1[e])) * nn.functional.linear(rows, self.w3[e])
            outputs.append(nn.functional.linear(hidden, self.w2[e]))
        if start != x.shape[0]:
            raise ValueError(f"GroupedExperts: counts sum to {start} rows but x has {x.shape[0]}")
        return torch.cat(outputs) if outputs else x.new_zeros(0, x.shape[-1])
