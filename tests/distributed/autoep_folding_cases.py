"""Rank-side cases of the folded AutoEP + AutoTP test: a tiny hand-written Mixtral-shaped MoE model
trained folded (``expert_parallel.autoep_size`` beside ``tensor_parallel.autotp_size``) and plain (data
parallel only) on the same ranks, losses and every parameter returned for comparison."""

from __future__ import annotations

from typing import Any

HIDDEN, FFN, EXPERTS, TOP_K, OUT, STEPS, LR = 16, 24, 4, 2, 8, 3, 0.05
_REFERENCE: dict[str, Any] = {}


def build_model(hidden: int = HIDDEN, ffn: int = FFN, experts: int = EXPERTS, top_k: int = TOP_K, out: int = OUT,
                layers: int = 2, dense: int = 2 * HIDDEN, init_scale: float = 0.3) -> Any:
    """Mixtral's module layout (``model.layers[i].mlp.gate`` / ``.experts.gate_up_proj`` / ``.down_proj``,
    what ``preset_model: mixtral`` detects, in shardwise and DeepSpeed alike) with a dense pair ``up``/``down``
    (``hidden -> dense -> hidden``) that the folded config splits column/row; seeded, so every call is the same
    model (expert weights ``init_scale`` x N(0, 1)). Only torch is imported (``benchmarks/autoep_folding_worker.py`` builds it under DeepSpeed too)."""
    import torch
    from torch import nn

    class Experts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * ffn, hidden) * init_scale)
            self.down_proj = nn.Parameter(torch.randn(experts, hidden, ffn) * init_scale)

    class SparseBlock(nn.Module):  # Mixtral's routing: softmax, top-k, renormalised, weights after
        def __init__(self) -> None:
            super().__init__()
            self.gate = nn.Linear(hidden, experts, bias=False)
            self.experts = Experts()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            flat = x.reshape(-1, hidden)
            scores, chosen = torch.topk(torch.softmax(self.gate(flat), dim=-1), top_k, dim=-1)
            scores = scores / scores.sum(dim=-1, keepdim=True)
            result_sum = torch.zeros_like(flat)
            for e in range(experts):
                token, slot = (chosen == e).nonzero(as_tuple=True)
                gate, up = (flat[token] @ self.experts.gate_up_proj[e].T).chunk(2, dim=-1)
                result = (nn.functional.silu(gate) * up) @ self.experts.down_proj[e].T
                result_sum.index_add_(0, token, result * scores[token, slot].unsqueeze(-1))
            return result_sum.view_as(x)

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.input_layernorm = nn.LayerNorm(hidden)
            self.up = nn.Linear(hidden, dense)  # column-parallel under the folded config
            self.down = nn.Linear(dense, hidden)  # row-parallel
            self.post_attention_layernorm = nn.LayerNorm(hidden)
            self.mlp = SparseBlock()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.down(torch.relu(self.up(self.input_layernorm(x))))
            return x + self.mlp(self.post_attention_layernorm(x))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = type("Config", (), {"model_type": "mixtral", "num_local_experts": experts,
                                              "num_experts_per_tok": top_k, "hidden_size": hidden,
                                              "intermediate_size": ffn})()
            self.model = nn.Module()
            self.model.layers = nn.ModuleList([Layer() for _ in range(layers)])
            self.lm_head = nn.Linear(hidden, out, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.model.layers:
                x = layer(x)
            return self.lm_head(x)

    torch.manual_seed(0)
    return Model()


def _config(stage: int, tp: int, ep: int) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
    }
    if tp > 1:
        config["expert_parallel"] = {"enabled": True, "autoep_size": ep, "preset_model": "mixtral"}
        config["tensor_parallel"] = {"autotp_size": tp, "partition_config": {"use_default_specs": False, "layer_specs": [
            {"patterns": [r".*\.up\.weight$"], "partition_type": "column"},
            {"patterns": [r".*\.down\.weight$"], "partition_type": "row"},
            {"patterns": [r".*\.weight$"], "partition_type": "skip"},
        ]}}
    return config


def _run(rank: int, stage: int, tp: int, ep: int, replica: int, replicas: int,
         tokens: int = 10) -> tuple[Any, list[float]]:
    import torch

    import shardwise
    from shardwise.comm import groups, mesh

    mesh.reset_layout()
    groups.clear_topology()
    engine, *_ = shardwise.initialize(model=build_model(), config=_config(stage, tp, ep))
    losses = []
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(100 + step * replicas + replica)  # one batch per replica
        x = torch.randn(1, tokens, HIDDEN, generator=generator)
        target = torch.randn(1, tokens, OUT, generator=generator)
        loss = ((engine(x) - target) ** 2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return engine, losses


def _gathered(local: Any, group: Any, dim: int) -> Any:
    import torch
    import torch.distributed as dist

    pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, local.contiguous(), group=group)
    return torch.cat(pieces, dim=dim)


def _whole_parameters(engine: Any, tp: int) -> dict[str, Any]:
    """The folded model's parameters as whole tensors under the plain model's names."""
    import torch

    from shardwise.autoep.layer import AutoEPMoELayer
    from shardwise.comm.mesh import current_layout

    layout = current_layout()
    whole: dict[str, Any] = {}
    for name, module in engine.module.named_modules():
        if isinstance(module, AutoEPMoELayer):
            w1, w2, w3 = (_gathered(getattr(module.experts, w).detach(), module.ep_group, 0) for w in ("w1", "w2", "w3"))
            whole[f"{name}.experts.gate_up_proj"] = torch.cat([w1, w3], dim=1)
            whole[f"{name}.experts.down_proj"] = w2
            whole[f"{name}.gate.weight"] = module.router.gate.weight.detach().clone()
    for name, param in engine.module.named_parameters():
        if ".experts." in name or ".router." in name:
            continue
        value = param.detach()
        if name.endswith(".up.weight") or name.endswith(".up.bias"):
            value = _gathered(value, layout.group_of("tp"), 0)
        elif name.endswith(".down.weight"):
            value = _gathered(value, layout.group_of("tp"), 1)
        whole[name] = value.clone()
    assert tp == layout.size_of("tp")
    return whole


def train_folded(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """The plain model on ``world`` data-parallel ranks (each replica's batch of ``case["tokens"]`` tokens on
    ``tp`` of them) and the folded one at ``case``'s ZeRO stage, tp and ep: the losses and each parameter's
    largest difference."""
    tp, ep, stage, tokens = case["tp"], case["ep"], case["stage"], case.get("tokens", 10)
    replicas, replica = world // tp, rank // tp
    key = f"{tp}-{tokens}"
    if key not in _REFERENCE:  # the plain run, once per spawn, tp and batch (folded runs reset the layout after it)
        plain, losses = _run(rank, 0, 1, 1, replica, replicas, tokens)
        _REFERENCE[key] = (losses, {n: p.detach().clone() for n, p in plain.module.named_parameters()})
        plain.destroy()
    plain_losses, plain_params = _REFERENCE[key]
    engine, losses = _run(rank, stage, tp, ep, replica, replicas, tokens)
    whole = _whole_parameters(engine, tp)
    layers = [m for m in engine.module.modules() if getattr(m, "folding_group_handles", None) is not None]
    differences = {name: float((whole[name] - plain_params[name]).abs().max()) for name in plain_params}
    scales = {name: float(plain_params[name].abs().max()) for name in plain_params}
    engine.destroy()
    return {"loss": losses, "plain_loss": list(plain_losses), "diff": differences, "scale": scales,
            "names": sorted(whole) == sorted(plain_params), "folded_layers": len(layers),
            "tp_size": layers[0].tp_size if layers else 0}

