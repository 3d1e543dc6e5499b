"""DeepSpeed's MoE layer: ``MoE`` (the user's module), ``MOELayer`` (gate, dispatch, experts,
combine) and ``TopKGate`` (the router).

``MoE(hidden_size, expert, num_experts, ep_size, k, ...)`` holds ``num_experts / ep_size`` copies
of ``expert`` on each rank; ``forward(x)`` returns ``(output, l_aux, exp_counts)``. The expert-
parallel group comes from the process layout (:mod:`shardwise.moe.parallelism`, which asks
``shardwise.comm.mesh`` for ``ep=ep_size``): ``shardwise.initialize`` declares it for every MoE
layer of the model, or call ``layer.set_deepspeed_parallelism()`` yourself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shardwise.comm.group_type import Group
from shardwise.moe import dispatch as routing
from shardwise.moe.experts import Experts
from shardwise.moe.gating import GateOutput, SparseGateOutput, top1gating, top2gating, topkgating
from shardwise.moe.parallelism import expert_parallel_group
from shardwise.utils.logging import logger

NOISY_GATE_POLICIES = (None, "None", "Jitter", "RSample")


def _jitter(x: Tensor, epsilon: float = 1e-2) -> Tensor:
    """``x`` times uniform noise in ``[1 - epsilon, 1 + epsilon]`` (the ``Jitter`` gate policy)."""
    return x * torch.empty_like(x).uniform_(1.0 - epsilon, 1.0 + epsilon)


class TopKGate(nn.Module):
    """The router: a bias-free linear layer ``wg`` to ``num_experts`` logits (computed in fp32),
    then top-1, top-2 or top-k gating (:mod:`shardwise.moe.gating`)."""

    def __init__(
        self,
        model_dim: int,
        num_experts: int,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 8,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        ep_group: Group = None,
        top2_2nd_expert_sampling: bool = True,
    ) -> None:
        super().__init__()
        if k < 1 or k > num_experts:
            raise ValueError(
                f"MoE: k={k}; rule: 1 <= k <= num_experts ({num_experts}); fix: choose k in that range"
            )
        self.wg = nn.Linear(model_dim, num_experts, bias=False)
        self.ep_group = ep_group
        self.ep_size = 1
        self.k = k
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.min_capacity = min_capacity
        self.noisy_gate_policy = noisy_gate_policy
        self.drop_tokens = drop_tokens
        self.use_rts = use_rts
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling
        self.wall_clock_breakdown = False
        self.gate_time = 0.0

    def _set_ep_group(self, ep_group: Group, ep_size: int = 1) -> None:
        self.ep_group, self.ep_size = ep_group, ep_size

    def forward(
        self, tokens: Tensor, used_token: Tensor | None = None, sparse_routes: bool = False, use_tutel: bool = False
    ) -> GateOutput | SparseGateOutput:
        """``(l_aux, combine_weights, dispatch_mask, exp_counts)`` for ``[S, M]`` tokens (with
        ``sparse_routes``: ``(l_aux, capacity, E, indices, locations, gates, exp_counts)``)."""
        x = tokens.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            x = _jitter(x)
        logits = F.linear(x, self.wg.weight.float())
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        group, size = self.ep_group, self.ep_size
        if self.k == 1:
            policy = self.noisy_gate_policy if self.training else None
            return top1gating(
                logits, factor, self.min_capacity, used_token, policy, self.drop_tokens, self.use_rts,
                group, sparse_routes, ep_size=size,
            )
        if self.k == 2:
            return top2gating(
                logits, factor, self.min_capacity, self.drop_tokens, group, self.top2_2nd_expert_sampling,
                sparse_routes, ep_size=size,
            )
        return topkgating(
            logits, self.k, factor, self.min_capacity, self.drop_tokens, group,
            sparse_routes=sparse_routes, ep_size=size,
        )


class MOELayer(nn.Module):
    """Gate, dispatch to expert slots, all-to-all, local experts, all-to-all back, combine (by the
    sparse routes: a gather in, a gather and weighted sum out, :mod:`shardwise.moe.dispatch`).

    After ``forward`` the layer keeps ``l_aux`` (the balancing loss) and ``exp_counts``.
    """

    def __init__(
        self, gate: TopKGate, experts: Experts, ep_group_name: str, ep_size: int, num_local_experts: int
    ) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.ep_group: Group = None
        self.ep_rank = 0  # this rank's place in its expert-parallel group (its experts' first index / L)
        self.ep_size = ep_size
        self.ep_group_name = ep_group_name
        self.num_local_experts = num_local_experts
        self.group_set = ep_size == 1
        self.l_aux: Tensor | None = None
        self.exp_counts: Tensor | None = None
        self.last_capacity = 0  # C of the last forward (benchmarks count the all-to-all bytes with it)
        self.wall_clock_breakdown = False

    def _set_ep_group(self, ep_group: Group, ep_rank: int = 0) -> None:
        self.ep_group, self.ep_rank = ep_group, ep_rank
        self.group_set = True
        self.gate._set_ep_group(ep_group, self.ep_size)

    def forward(self, *inputs: Tensor, **_: object) -> Tensor:
        """``inputs[0]``: ``[..., M]`` tokens; ``inputs[1]`` (optional): the used-token mask (top-1)."""
        if not self.group_set:
            raise RuntimeError(
                f"MoE layer with ep_size={self.ep_size} has no expert-parallel group: "
                "shardwise.initialize declares it for the model's MoE layers; when running without "
                "initialize, call moe.set_deepspeed_parallelism() on every rank first"
            )
        x = inputs[0]
        hidden = x.shape[-1]
        tokens = x.reshape(-1, hidden)
        used = inputs[1] if len(inputs) > 1 else None
        self.l_aux, cap, experts, indices, locations, gates, self.exp_counts = self.gate(tokens, used, True)
        cap = self.last_capacity = int(cap)
        slots = routing.route_slots(indices, locations, experts, cap)
        block = routing.sparse_encode(tokens, slots, experts, cap)
        block = routing.exchange(block, self.ep_group, self.ep_size)
        block = block.reshape(self.ep_size, self.num_local_experts, -1, hidden)
        out = self.experts(block).reshape(self.ep_size * self.num_local_experts, -1, hidden)
        out = routing.exchange(out, self.ep_group, self.ep_size).reshape(experts * cap, hidden)
        return routing.sparse_decode(out, slots, gates, tokens.shape[0]).reshape(x.shape)


class MoE(nn.Module):
    """DeepSpeed's ``deepspeed.moe.layer.MoE``: a mixture of ``num_experts`` copies of ``expert``,
    ``num_experts / ep_size`` of them on each rank, routed top-``k``.

    ``forward(hidden_states, used_token=None)`` returns ``(output, l_aux, exp_counts)``; add
    ``l_aux`` (times a coefficient) to the loss. ``use_residual``: PR-MoE, the output mixed with a
    dense copy of ``expert`` by a learned softmax coefficient. ``use_tutel`` is accepted and said to
    have no effect (torch's gathers do the dispatch). ``enable_expert_tensor_parallelism`` is refused: the
    experts are whole on each rank.
    """

    def __init__(
        self,
        hidden_size: int,
        expert: nn.Module,
        num_experts: int = 1,
        ep_size: int = 1,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 4,
        use_residual: bool = False,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        use_tutel: bool = False,
        enable_expert_tensor_parallelism: bool = False,
        top2_2nd_expert_sampling: bool = True,
    ) -> None:
        super().__init__()
        _check_arguments(num_experts, ep_size, noisy_gate_policy, enable_expert_tensor_parallelism)
        if use_tutel:
            logger.info("MoE(use_tutel=True): Tutel is not used; torch's gathers do the dispatch (same results)")
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = enable_expert_tensor_parallelism
        self.ep_size = ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        gate = TopKGate(
            hidden_size,
            num_experts,
            k,
            capacity_factor,
            eval_capacity_factor,
            min_capacity,
            noisy_gate_policy,
            drop_tokens,
            use_rts,
            None,
            top2_2nd_expert_sampling,
        )
        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        self.deepspeed_moe = MOELayer(gate, experts, self.expert_group_name, ep_size, self.num_local_experts)
        if use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """Take the expert-parallel group of ``ep_size`` from the process layout (collective:
        every rank calls it). ``use_data_before_expert_parallel_=True`` is refused (shardwise's
        layout puts expert ranks consecutive)."""
        if use_data_before_expert_parallel_:
            raise ValueError(
                "MoE.set_deepspeed_parallelism(use_data_before_expert_parallel_=True): shardwise's process "
                "layout makes expert-parallel groups of consecutive ranks only; fix: leave it False"
            )
        self.deepspeed_moe._set_ep_group(
            *expert_parallel_group(self.ep_size, source=f"MoE(ep_size={self.ep_size})")
        )

    def forward(
        self, hidden_states: Tensor, used_token: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``(output, l_aux, exp_counts)``."""
        if used_token is None:
            output = self.deepspeed_moe(hidden_states)
        else:
            output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            dense = self.mlp(hidden_states)
            dense = dense[0] if isinstance(dense, tuple) else dense
            coefficient = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coefficient[..., 0:1] + dense * coefficient[..., 1:]
        assert self.deepspeed_moe.l_aux is not None and self.deepspeed_moe.exp_counts is not None
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts


def _check_arguments(
    num_experts: int, ep_size: int, noisy_gate_policy: str | None, expert_tensor_parallel: bool
) -> None:
    if ep_size < 1 or num_experts % ep_size != 0:
        raise ValueError(
            f"MoE: num_experts={num_experts}, ep_size={ep_size}; rule: num_experts is a multiple of "
            "ep_size (each rank holds num_experts / ep_size experts); fix: change one of them"
        )
    if noisy_gate_policy not in NOISY_GATE_POLICIES:
        raise ValueError(
            f"MoE: noisy_gate_policy={noisy_gate_policy!r}; rule: one of None, 'None', 'Jitter', "
            "'RSample'; fix: use one of those"
        )
    if expert_tensor_parallel:
        raise NotImplementedError(
            "MoE(enable_expert_tensor_parallelism=True): shardwise keeps each expert whole on its rank "
            "(no tensor-parallel experts); fix: leave it False"
        )
