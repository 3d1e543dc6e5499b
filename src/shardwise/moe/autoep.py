"""AutoEP: DeepSpeed's ``expert_parallel`` config section on a transformers Mixtral or Qwen3-MoE model.

``initialize`` reads the section; with ``enabled: true`` it declares ``ep = autoep_size`` to the
process layout and replaces each MoE block's ``experts`` module (transformers' ``MixtralExperts`` /
``Qwen3MoeExperts``: ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``, ``act_fn``) by
:class:`ExpertParallelExperts`, which keeps this rank's ``E / ep`` experts (a run of consecutive
global indices, as :class:`~shardwise.moe.layer.MoE` does) and is called exactly like the original
``experts(hidden_states, top_k_index, top_k_weights)``. The router and everything else of the model
stay as they are (the router stays replicated, the model's own balancing loss stays).

Routing is dropless: every route travels, in variable-sized all-to-alls (row counts exchanged
first). Each token's results are added in ascending expert order, as transformers' loop adds them, so
an ``ep`` run computes what the unconverted model computes (up to the row count of the expert
matmuls). The kept experts are marked as expert parameters (``allreduce=False``,
``group_name="ep_size_<ep>"``), so ZeRO 0-2 reduce them over the expert-data-parallel group.

Keys: ``enabled``, ``autoep_size``, ``preset_model`` (``"mixtral"`` or ``"qwen3_moe"``; default: the
model's ``config.model_type``), ``top_k`` (sets the router's ``top_k``). Any other key is refused by
name (DeepSpeed's AutoEP has more: its own router, load-balance coefficient, tensor-parallel experts).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from shardwise.comm.group_type import Group
from shardwise.moe import dispatch as routing

SUPPORTED_KEYS = frozenset({"enabled", "autoep_size", "preset_model", "top_k"})
PRESETS: dict[str, tuple[str, ...]] = {
    "mixtral": ("MixtralSparseMoeBlock",),
    "qwen3_moe": ("Qwen3MoeSparseMoeBlock",),
}


@dataclass(frozen=True)
class AutoEPSettings:
    """The ``expert_parallel`` section as shardwise acts on it."""

    autoep_size: int
    preset_model: str | None = None
    top_k: int | None = None


def _fail(key: str, value: object, rule: str, fix: str) -> ValueError:
    return ValueError(f"expert_parallel.{key} = {value!r}: {rule}; fix: {fix}")


def autoep_settings(section: Mapping[str, Any] | None) -> AutoEPSettings | None:
    """The settings when the section enables AutoEP, else None; bad or unsupported keys refused."""
    if not section or not section.get("enabled", False):
        return None
    unknown = sorted(set(section) - SUPPORTED_KEYS)
    if unknown:
        raise _fail(unknown[0], section[unknown[0]], "not supported by shardwise's AutoEP",
                    f"remove it (supported: {', '.join(sorted(SUPPORTED_KEYS))})")
    size = section.get("autoep_size", 1)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise _fail("autoep_size", size, "an int >= 1", "set the number of ranks that share the experts")
    preset = section.get("preset_model")
    if preset is not None and preset not in PRESETS:
        raise _fail("preset_model", preset, f"one of {sorted(PRESETS)}", "name the model family or leave it out")
    top_k = section.get("top_k")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise _fail("top_k", top_k, "an int >= 1", "set how many experts each token goes to")
    return AutoEPSettings(size, preset, top_k)


class ExpertParallelExperts(nn.Module):
    """This rank's ``num_local_experts`` of a transformers fused experts module, the others reached
    through the expert-parallel all-to-all. ``forward(hidden [T, H], top_k_index [T, k],
    top_k_weights [T, k]) -> [T, H]``, as the module it replaces."""

    def __init__(self, original: Any, ep_size: int, ep_rank: int, group: Group) -> None:
        super().__init__()
        total = int(original.num_experts)
        if total % ep_size:
            raise ValueError(
                f"expert_parallel.autoep_size = {ep_size}: the model has {total} experts per layer; rule: "
                "autoep_size divides the number of experts; fix: choose a divisor"
            )
        self.num_experts, self.ep_size, self.group = total, ep_size, group
        self.num_local_experts = total // ep_size
        self.first = ep_rank * self.num_local_experts
        keep = slice(self.first, self.first + self.num_local_experts)
        self.gate_up_proj = nn.Parameter(original.gate_up_proj.detach()[keep].clone())
        self.down_proj = nn.Parameter(original.down_proj.detach()[keep].clone())
        self.act_fn: Callable[[Tensor], Tensor] = original.act_fn
        for param in (self.gate_up_proj, self.down_proj):
            param.allreduce = False  # type: ignore[attr-defined]
            param.group_name = f"ep_size_{ep_size}"  # type: ignore[attr-defined]

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        tokens, k = top_k_index.shape
        experts = top_k_index.reshape(-1)
        order = torch.argsort(experts, stable=True)  # routes by expert: by destination rank, then expert
        sorted_experts = experts[order]
        sorted_tokens = torch.arange(tokens, device=experts.device).repeat_interleave(k)[order]
        send = torch.bincount(sorted_experts // self.num_local_experts, minlength=self.ep_size)
        recv = routing.exchange_counts(send, self.group)
        send_rows, recv_rows = send.tolist(), recv.tolist()
        local_ids = routing.exchange_ids(sorted_experts - (sorted_experts // self.num_local_experts)
                                         * self.num_local_experts, send_rows, recv_rows, self.group)
        rows = routing.AllToAllV.apply(self.group, hidden_states[sorted_tokens], send_rows, recv_rows)
        results = torch.zeros_like(rows)
        for j in range(self.num_local_experts):
            mine = torch.nonzero(local_ids == j).squeeze(1)
            if mine.numel() == 0:
                continue  # no token for this expert: it gets no gradient (ZeRO treats it as zero)
            gate, up = nn.functional.linear(rows[mine], self.gate_up_proj[j]).chunk(2, dim=-1)
            out = nn.functional.linear(self.act_fn(gate) * up, self.down_proj[j])
            results = results.index_copy(0, mine, out)
        back = routing.AllToAllV.apply(self.group, results, recv_rows, send_rows)
        weighted = back * top_k_weights.reshape(-1)[order].unsqueeze(-1)
        final = torch.zeros_like(hidden_states)
        return final.index_add(0, sorted_tokens, weighted.to(final.dtype))


def convert_model(model: nn.Module, settings: AutoEPSettings, group: Group, ep_rank: int) -> dict[int, nn.Parameter]:
    """Replace the experts of every MoE block of ``model`` (in place); returns ``{id(old parameter):
    new parameter}`` so parameter lists built before the conversion can be re-pointed."""
    family = settings.preset_model or str(getattr(getattr(model, "config", None), "model_type", ""))
    if family not in PRESETS:
        raise _fail("preset_model", settings.preset_model, f"the model's type {family!r} is not one of "
                    f"{sorted(PRESETS)}", "use a Mixtral or Qwen3-MoE model, or name its family")
    replaced: dict[int, nn.Parameter] = {}
    blocks: list[Any] = [m for m in model.modules() if type(m).__name__ in PRESETS[family]]
    for block in blocks:
        new = ExpertParallelExperts(block.experts, settings.autoep_size, ep_rank, group)
        replaced[id(block.experts.gate_up_proj)] = new.gate_up_proj
        replaced[id(block.experts.down_proj)] = new.down_proj
        block.experts = new
        if settings.top_k is not None:
            block.gate.top_k = settings.top_k
            if hasattr(block, "top_k"):
                block.top_k = settings.top_k
    if not replaced:
        raise ValueError(
            f"expert_parallel.enabled = true: no {' / '.join(PRESETS[family])} block in the model; fix: "
            "use a transformers Mixtral or Qwen3-MoE model, or disable the section"
        )
    return replaced


def repoint(params: Any, replaced: Mapping[int, nn.Parameter]) -> Any:
    """``model_parameters`` (tensors or groups) with converted expert parameters swapped for their
    replacements (other entries as they were)."""
    if isinstance(params, (list, tuple)):
        out = [repoint(p, replaced) for p in params]
        return out if isinstance(params, list) else tuple(out)
    if isinstance(params, dict):
        return {**params, "params": repoint(list(params["params"]), replaced)}
    if isinstance(params, torch.Tensor):
        return replaced.get(id(params), params)
    return params
