"""Rank-side cases of the ZeRO stage-3 expert-parallel tests (test_moe_stage3_ep.py).

Two models: the tiny MoE GPT of moe_cases (``shardwise.moe.layer.MoE``, 4 experts, top-2) and a tiny
random transformers Mixtral converted by the ``expert_parallel`` section (AutoEP, 4 experts, top-2;
``autoep_size`` 1 still converts, so both runs have the same parameters). Every case returns the
parameters *whole and by global name* (DTensor shards gathered over their mesh; an expert by its
global index), so runs at different expert-parallel sizes compare name by name.
"""

from __future__ import annotations

from typing import Any

from moe_cases import BATCH, OPTIMIZERS, batches, build_model

STEPS = 3
CLIP = 0.05  # below the gradient norm: clipping acts on every step (checked), so the norm must be right
VOCAB = 64


def _mixtral(seed: int) -> Any:
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    config = MixtralConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32,
        output_router_logits=True,
    )
    return MixtralForCausalLM(config)


def whole_params(model: Any) -> dict[str, Any]:
    """Every parameter whole (fp32) under its global name: a MoE layer's experts by global index
    (``shardwise.moe.naming``), an AutoEP layer's stacked expert rows as ``<name>#<global expert>``.
    Collective over each parameter's mesh (every rank calls it)."""
    from shardwise.autoep.layer import AutoEPMoELayer
    from shardwise.moe.naming import global_expert_names

    renames = global_expert_names(model)
    autoep = {
        f"{prefix}.experts.{w}": layer
        for prefix, layer in model.named_modules()
        if isinstance(layer, AutoEPMoELayer)
        for w in ("w1", "w2", "w3")
    }
    out = {}
    for name, p in model.named_parameters():
        value = p.detach()
        value = (value.full_tensor() if hasattr(value, "full_tensor") else value).float().clone()
        if name in autoep:
            first = autoep[name].ep_rank * autoep[name].num_local_experts
            out.update({f"{name}#{first + i}": value[i].clone() for i in range(value.shape[0])})
        else:
            out[renames.get(name, name)] = value
    return out


def expert_elements(model: Any) -> tuple[int, int]:
    """``(logical, stored)`` expert elements on this rank: the experts it computes (a DTensor's shape
    over its mesh), and what it keeps in memory (its local shards)."""
    from shardwise.moe.utils import is_moe_param

    experts = [p for p in model.parameters() if is_moe_param(p)]
    stored = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in experts)
    return sum(p.numel() for p in experts), stored


def _engine(case: dict[str, Any], *, fresh: bool = False) -> tuple[Any, Any]:
    """The engine and model of ``case``; ``fresh``: other initial weights (a run that resumes)."""
    import torch

    import shardwise
    from shardwise.comm import groups, mesh

    mesh.reset_layout()
    groups.clear_topology()
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": BATCH if case["model"] == "moe" else 2,
        "optimizer": OPTIMIZERS[case.get("optimizer", "SGD")],
        "zero_optimization": {"stage": case.get("stage", 3), **case.get("zero", {})},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": case.get("clip", CLIP),
        **case.get("config", {}),  # more top-level keys (gradient_accumulation_steps, ...)
    }
    if case.get("bf16"):
        config["bf16"] = {"enabled": True}
    if case["model"] == "moe":
        torch.manual_seed(7)  # the gate's sampling: the same stream for every run
        model = build_model(case["ep"], seed=99 if fresh else 1234)
    else:
        model = _mixtral(99 if fresh else 0)
        config["expert_parallel"] = {"enabled": True, "autoep_size": case["ep"], "preset_model": "mixtral"}
    engine, *_ = shardwise.initialize(model=model, config=config)
    return engine, model


def _data(case: dict[str, Any], rank: int, steps: int) -> list[Any]:
    import torch

    if case["model"] == "moe":
        return batches(rank, steps)
    # one batch per rank, again at every step: the loss then falls step after step (it trains)
    batch = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(rank))
    return [batch] * steps


def _loss(engine: Any, case: dict[str, Any], batch: Any) -> Any:
    if case["model"] == "moe":
        return engine(batch)[0]
    return engine(input_ids=batch, labels=batch).loss


def train(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """``STEPS`` steps; the losses, gradient norms, every parameter whole by global name and the
    expert elements this rank holds. A ``refuse`` case returns the error ``initialize`` raised."""
    if case.get("refuse"):
        try:
            _engine(case)
        except (ValueError, AssertionError) as error:
            return {"error": f"{type(error).__name__}: {error}", "assertion": isinstance(error, AssertionError)}
        return {"error": None}
    engine, model = _engine(case)
    losses, norms = [], []
    for batch in _data(case, rank, STEPS):
        loss = _loss(engine, case, batch)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        norm = engine.get_global_grad_norm()  # None inside an accumulation window
        norms.append(None if norm is None else float(norm))
    from shardwise.moe.utils import is_moe_param

    families = sorted({str(getattr(p, "ds_zero_placement_family", None)) for p in model.parameters() if is_moe_param(p)})
    out = {"loss": losses, "norm": norms, "params": whole_params(model), "experts": expert_elements(model),
           "families": families}
    engine.destroy()
    return out


def save_then_resume(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """Train 2 steps at ``case["save_ep"]`` and save, then a third step (the continuing run);
    resume the checkpoint at ``case["load_ep"]`` (other initial weights) and take the same third
    step. Returns the parameters at save and after the load, and both third steps' losses and
    parameters."""
    import torch

    data = _data(case, rank, 3)
    engine, model = _engine({**case, "ep": case["save_ep"]})
    for batch in data[:2]:
        engine.backward(_loss(engine, case, batch))
        engine.step()
    engine.save_checkpoint(case["dir"], tag="z3")
    saved = whole_params(model)
    continued = _last_step(engine, model, case, data[2])
    load_stage = case.get("load_stage", case.get("stage", 3))  # another stage reads the checkpoint too
    engine, model = _engine({**case, "ep": case["load_ep"], "stage": load_stage}, fresh=True)  # other weights
    engine.load_checkpoint(case["dir"], tag="z3")
    loaded = whole_params(model)
    resumed = _last_step(engine, model, case, data[2])
    torch.distributed.barrier()
    return {"saved": saved, "loaded": loaded, "continued": continued, "resumed": resumed}


def _last_step(engine: Any, model: Any, case: dict[str, Any], batch: Any) -> dict[str, Any]:
    """One more step on ``batch``, then the engine's end: the loss and every parameter whole."""
    loss = _loss(engine, case, batch)
    engine.backward(loss)
    engine.step()
    result = {"loss": loss.item(), "params": whole_params(model)}
    engine.destroy()
    return result


def converted_under_zero_init(rank: int, world: int, case: dict[str, Any]) -> dict[str, bool]:
    """A Mixtral built under ``zero.Init`` (its parameters partitioned placeholders), its first MoE
    block's router and experts set to known values, converted by AutoEP at ``case["ep"]`` at stage 3:
    whether the router and each of this rank's experts hold exactly the source's values."""
    import torch

    import shardwise
    from shardwise.comm import groups, mesh

    mesh.reset_layout()
    groups.clear_topology()
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2, "optimizer": OPTIMIZERS["SGD"], "zero_optimization": {"stage": 3},
        "zero_allow_untested_optimizer": True,
        "expert_parallel": {"enabled": True, "autoep_size": case["ep"], "preset_model": "mixtral"},
    }
    with shardwise.zero.Init(config_dict_or_path=config):
        model = _mixtral(0)
    block = model.model.layers[0].mlp
    source = [block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj]
    with shardwise.zero.GatheredParameters(source, modifier_rank=0):
        for p in (block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj):  # the gathered ones
            p.data.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    with shardwise.zero.GatheredParameters(source, modifier_rank=None):
        gate, gate_up, down = (t.detach().clone() for t in
                               (block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj))
    engine, *_ = shardwise.initialize(model=model, config=config)
    params, layer, prefix = whole_params(model), model.model.layers[0].mlp, "model.layers.0.mlp."
    half = gate_up.shape[1] // 2
    same = {"router": bool(torch.equal(params[prefix + "router.gate.weight"], gate))}
    for e in range(layer.ep_rank * layer.num_local_experts, (layer.ep_rank + 1) * layer.num_local_experts):
        same[f"w1.{e}"] = bool(torch.equal(params[f"{prefix}experts.w1#{e}"], gate_up[e, :half]))
        same[f"w3.{e}"] = bool(torch.equal(params[f"{prefix}experts.w3#{e}"], gate_up[e, half:]))
        same[f"w2.{e}"] = bool(torch.equal(params[f"{prefix}experts.w2#{e}"], down[e]))
    engine.destroy()
    return same


def modify_gathered(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """Inside ``GatheredParameters([dense, expert], modifier_rank=0)`` every rank writes its own values
    into a dense parameter and an expert parameter; what each rank holds afterwards (whole)."""
    import torch

    import shardwise
    from shardwise.moe.utils import is_moe_param

    engine, model = _engine(case)
    dense = next(n for n, p in model.named_parameters() if not is_moe_param(p))
    expert = next(n for n, p in model.named_parameters() if is_moe_param(p))
    values = {dense: rank + 1.0, expert: 10.0 * (rank + 1)}
    # the block puts the whole parameters on the module: read them from there, by name
    gathered = shardwise.zero.GatheredParameters([model.get_parameter(n) for n in values], modifier_rank=0)
    with gathered, torch.no_grad():
        for name, value in values.items():
            model.get_parameter(name).fill_(value)
    with shardwise.zero.GatheredParameters([model.get_parameter(n) for n in values]):
        held = {kind: sorted(set(model.get_parameter(n).detach().flatten().tolist()))
                for kind, n in (("dense", dense), ("expert", expert))}
    engine.destroy()
    return held


def run_case(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """Dispatch: ``case["kind"]`` is ``"train"``, ``"resume"``, ``"zero_init"``, ``"modify"`` or ``"full_grads"``
    (moe_edge_cases' ``safe_get_full_grad`` / ``safe_get_full_fp32_param`` of every expert, by global index)."""
    if case["kind"] == "zero_init":
        return converted_under_zero_init(rank, world, case)
    if case["kind"] == "modify":
        return modify_gathered(rank, world, case)
    if case["kind"] == "full_grads":
        from moe_edge_cases import full_expert_gradients

        return full_expert_gradients(rank, world, case)
    return save_then_resume(rank, world, case) if case["kind"] == "resume" else train(rank, world, case)
