"""``Experts``: this rank's copies of the expert module, marked as expert parameters."""

from __future__ import annotations

import copy

import torch
from torch import nn


class Experts(nn.Module):
    """``num_local_experts`` deep copies of ``expert`` (identical at start, as DeepSpeed's).

    Each parameter carries DeepSpeed's public marks: ``allreduce = False`` (an expert parameter,
    :func:`shardwise.moe.utils.is_moe_param`) and ``group_name`` (its expert-parallel group's name,
    ``"ep_size_<N>"``), which ZeRO reads to reduce its gradient over the expert-data-parallel group.
    ``forward`` takes ``[ep_size, L, C, M]``: the input is split into ``L`` chunks along dimension 1
    and chunk ``j`` (every source rank's tokens for local expert ``j``) goes to expert ``j``.
    """

    def __init__(
        self, expert: nn.Module, num_local_experts: int = 1, expert_group_name: str | None = None
    ) -> None:
        super().__init__()
        self.deepspeed_experts = nn.ModuleList([copy.deepcopy(expert) for _ in range(num_local_experts)])
        self.num_local_experts = num_local_experts
        for module in self.deepspeed_experts:
            for param in module.parameters():
                param.allreduce = False  # type: ignore[attr-defined]
                param.group_name = expert_group_name  # type: ignore[attr-defined]

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """Expert ``j`` on chunk ``j`` of ``inputs`` along dimension 1; outputs concatenated there."""
        chunks = inputs.chunk(self.num_local_experts, dim=1)
        outputs = []
        for chunk, module in zip(chunks, self.deepspeed_experts):
            out = module(chunk)
            outputs.append(out[0] if isinstance(out, tuple) else out)  # a (output, bias) pair: the output
        return torch.cat(outputs, dim=1)
