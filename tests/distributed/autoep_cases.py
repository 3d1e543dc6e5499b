"""Rank-side cases of the AutoEP tests: tiny transformers Mixtral / Qwen3-MoE models from a config."""

from __future__ import annotations

from typing import Any

VOCAB, STEPS = 64, 6


def _model(family: str) -> Any:
    import torch

    torch.manual_seed(0)
    if family == "mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM

        config = MixtralConfig(
            vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32,
            output_router_logits=True,
        )
        return MixtralForCausalLM(config)
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=32, head_dim=8, output_router_logits=True, norm_topk_prob=True,
    )
    return Qwen3MoeForCausalLM(config)


def train(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """``STEPS`` steps of a tiny MoE model, with AutoEP at ``case["ep"]`` (1: the section left out);
    a ``resume_at_ep1`` case is :func:`resume_at_ep1`."""
    if case.get("resume_at_ep1"):
        return resume_at_ep1(rank, world, case)
    import torch

    import shardwise
    from shardwise.comm import groups, mesh
    from shardwise.moe.utils import is_moe_param

    mesh.reset_layout()
    groups.clear_topology()
    model = _model(case["family"])
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.5}},
        "zero_optimization": {"stage": case["stage"]},
        "zero_allow_untested_optimizer": True,
    }
    if case["ep"] > 1:
        config["expert_parallel"] = {"enabled": True, "autoep_size": case["ep"], "preset_model": case["family"]}
    engine, *_ = shardwise.initialize(model=model, model_parameters=list(model.parameters()), config=config)
    generator = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (2, 12), generator=generator)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    experts = sum(p.numel() for p in model.parameters() if is_moe_param(p))
    total = sum(p.numel() for p in model.parameters())
    engine.destroy()
    return {"loss": losses, "expert_numel": experts, "numel": total}


def resume_at_ep1(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """Train at AutoEP ep=2, save, resume the checkpoint at ep=1: every expert comes back whole."""
    import torch

    import shardwise
    from shardwise.comm import groups, mesh, torch_api

    def engine_at(ep: int) -> Any:
        mesh.reset_layout()
        groups.clear_topology()
        model = _model("mixtral")
        config = {
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "SGD", "params": {"lr": 0.5}},
            "zero_optimization": {"stage": case["stage"]},
            "zero_allow_untested_optimizer": True,
            "expert_parallel": {"enabled": True, "autoep_size": ep, "preset_model": "mixtral"},
        }
        return shardwise.initialize(model=model, config=config)[0]

    engine = engine_at(2)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    local = engine.module.model.layers[0].mlp.experts.w2.detach()
    pieces = [torch.empty_like(local) for _ in range(world)]
    torch_api.all_gather(pieces, local.contiguous())
    try:
        engine.save_16bit_model(case["dir"])
        refused = False
    except ValueError as error:  # one file from rank 0 would hold only its own experts
        refused = "autoep_size > 1" in str(error)
    engine.save_checkpoint(case["dir"], tag="ep2")
    engine.destroy()
    # DeepSpeed's MoE files next to shardwise's: expert e of layer 0 in layer_0_expert_e, whole
    tag = f"{case['dir']}/ep2"
    main = torch.load(f"{tag}/mp_rank_00_model_states.pt", weights_only=False)
    prefix = "model.layers.0.mlp."
    from_files = torch.stack([torch.load(f"{tag}/layer_0_expert_{e}_mp_rank_00_model_states.pt")[
        f"{prefix}experts.w2.{e}"] for e in range(4)])
    ds_files = {
        "experts_equal": bool(torch.equal(from_files, torch.cat(pieces))),
        "layers": [(e["module_path"], e["num_experts"], e["ep_size"]) for e in main["ds_autoep_layers"]],
        "router_twice": bool(torch.equal(main["module"][f"{prefix}gate.gate.weight"], main["module"][f"{prefix}router.gate.weight"]))
        if f"{prefix}gate.gate.weight" in main["module"] else False,
        "no_experts_in_main": not any(".experts.w" in k for k in main["module"]),
    }
    resumed = engine_at(1)
    resumed.load_checkpoint(case["dir"], tag="ep2")
    whole = resumed.module.model.layers[0].mlp.experts.w2.detach()
    resumed.destroy()
    return {"equal": bool(torch.equal(torch.cat(pieces), whole)), "experts": whole.shape[0], "refused": refused,
            "ds_files": ds_files}
