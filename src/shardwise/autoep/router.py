"""Token-choice top-k routing for AutoEP layers: scores, the optional group-limited choice, the
chosen experts' weights and the per-expert token histogram."""

from __future__ import annotations

import torch
from torch import Tensor, nn


def count_tokens_per_expert(selected_experts: Tensor, num_experts: int) -> Tensor:
    """How many routes go to each expert: an int32 ``[num_experts]`` histogram of ``selected_experts``."""
    return torch.bincount(selected_experts.reshape(-1), minlength=num_experts).to(torch.int32)


class TokenChoiceTopKRouter(nn.Module):
    """Each token picks its ``top_k`` experts by score.

    ``gate`` (a linear ``dim -> num_experts``) gives the logits; ``score_func`` (``"softmax"`` or
    ``"sigmoid"``, in fp32) the scores. With ``num_expert_groups`` the experts form that many
    consecutive groups and a token chooses only inside the ``num_limited_groups`` groups with the
    highest sum of their two best scores. ``e_score_correction_bias`` (DeepSeek-V3) and an
    ``expert_bias`` argument shift the choice, never the weights. The chosen scores are divided by
    their sum when ``route_norm`` and multiplied by ``route_scale``.

    ``forward(x [T, dim]) -> (top_scores [T, k] fp32, selected_experts [T, k], counts [E] int32)``.
    """

    def __init__(self, dim: int, num_experts: int, num_expert_groups: int | None, num_limited_groups: int | None,
                 top_k: int, score_func: str, route_norm: bool, route_scale: float, gate_bias: bool,
                 group_score_func: str = "top2_sum") -> None:
        super().__init__()
        if score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"score_func = {score_func!r}: one of 'softmax', 'sigmoid'; fix: choose one")
        if group_score_func not in ("top2_sum", "max"):
            raise ValueError(f"group_score_func = {group_score_func!r}: one of 'top2_sum', 'max'; fix: choose one")
        self.gate = nn.Linear(dim, num_experts, bias=gate_bias)
        self.num_experts, self.top_k = num_experts, top_k
        self.num_expert_groups, self.num_limited_groups = num_expert_groups, num_limited_groups
        self.score_func, self.route_norm, self.route_scale = score_func, route_norm, route_scale
        self.group_score_func = group_score_func
        self.e_score_correction_bias: Tensor | None = None

    def scores(self, logits: Tensor) -> Tensor:
        """``score_func`` of the logits, in fp32."""
        logits = logits.to(torch.float32)
        return torch.softmax(logits, dim=-1) if self.score_func == "softmax" else torch.sigmoid(logits)

    def _limit_to_groups(self, choice: Tensor) -> Tensor:
        groups, limited = self.num_expert_groups, self.num_limited_groups
        assert groups is not None
        if limited is None or not 1 <= limited <= groups or self.num_experts % groups:
            raise ValueError(
                f"group-limited routing: num_expert_groups={groups} must divide num_experts={self.num_experts} "
                f"and num_limited_groups={limited} be in [1, {groups}]; fix: set both accordingly"
            )
        per_group = self.num_experts // groups
        grouped = choice.view(-1, groups, per_group)
        if self.group_score_func == "max":
            group_scores = grouped.max(dim=-1).values
        else:
            if per_group < 2:
                raise ValueError(f"group_score_func 'top2_sum' needs >= 2 experts per group, got {per_group}")
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        keep = torch.topk(group_scores, k=limited, dim=-1).indices
        dropped = torch.ones_like(group_scores, dtype=torch.bool).scatter(1, keep, False)
        return grouped.masked_fill(dropped.unsqueeze(-1), float("-inf")).view(-1, self.num_experts)

    def forward(self, x: Tensor, expert_bias: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Route ``x [T, dim]``: the chosen experts' weights, their indices and the histogram."""
        return self.route(self.gate(x), expert_bias)

    def route(self, logits: Tensor, expert_bias: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`forward` from the gate's logits ``[T, num_experts]``."""
        scores = self.scores(logits)
        choice = scores if expert_bias is None else scores + expert_bias
        if self.e_score_correction_bias is not None:
            choice = choice + self.e_score_correction_bias.to(choice.dtype).unsqueeze(0)
        if self.num_expert_groups is not None:
            choice = self._limit_to_groups(choice)
        selected = torch.topk(choice, k=self.top_k, dim=-1).indices
        top_scores = scores.gather(1, selected)
        if self.route_norm:
            top_scores = top_scores / top_scores.sum(dim=-1, keepdim=True)
        top_scores = top_scores * self.route_scale
        return top_scores, selected, count_tokens_per_expert(selected, self.num_experts)
