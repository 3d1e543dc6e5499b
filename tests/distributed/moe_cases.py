"""Rank-side cases of the expert-parallel tests: a tiny MoE GPT trained by shardwise.initialize.

The model: token + position embeddings, ``LAYERS`` blocks of causal self-attention followed by a
``shardwise.moe.layer.MoE`` MLP (4 experts, top-2), a language-model head. The loss is the
next-token cross entropy plus ``AUX_COEF`` times the layers' balancing losses. Every rank builds
the model from the same seed (so both runs start from the same weights) and draws its own tokens.
"""

from __future__ import annotations

from typing import Any

VOCAB, HIDDEN, SEQ, BATCH, LAYERS, EXPERTS, TOP_K = 32, 16, 8, 4, 2, 4, 2
AUX_COEF = 0.01
# Adam is blind to a constant factor on a gradient; SGD is not (it catches a wrong expert scaling)
OPTIMIZERS = {
    "Adam": {"type": "Adam", "params": {"lr": 1e-2}},
    "SGD": {"type": "SGD", "params": {"lr": 0.5, "momentum": 0.9}},
}


def build_model(ep_size: int, seed: int = 1234, moe_class: Any = None, **moe_kwargs: Any) -> Any:
    """The tiny MoE GPT with ``ep_size`` expert parallelism (same weights for every ``ep_size``).
    ``moe_class``: the MoE layer (default shardwise's; the interop benchmark passes DeepSpeed's)."""
    import torch
    from torch import nn

    if moe_class is None:
        from shardwise.moe.layer import MoE
    else:
        MoE = moe_class

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm1 = nn.LayerNorm(HIDDEN)
            self.attn = nn.MultiheadAttention(HIDDEN, 2, batch_first=True)
            self.norm2 = nn.LayerNorm(HIDDEN)
            expert = nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.GELU(), nn.Linear(2 * HIDDEN, HIDDEN))
            options = {"k": TOP_K, "capacity_factor": 1.0, "min_capacity": 0, **moe_kwargs}
            self.moe = MoE(HIDDEN, expert, num_experts=EXPERTS, ep_size=ep_size, **options)

        def forward(self, x: Any) -> tuple[Any, Any]:
            n = x.shape[1]
            mask = torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1)
            h = self.norm1(x)
            x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
            out, l_aux, _ = self.moe(self.norm2(x))
            return x + out, l_aux

    class TinyMoEGPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, HIDDEN)
            self.pos = nn.Parameter(torch.randn(SEQ, HIDDEN) * 0.02)
            self.blocks = nn.ModuleList([Block() for _ in range(LAYERS)])
            self.head = nn.Linear(HIDDEN, VOCAB)

        def forward(self, tokens: Any) -> tuple[Any, Any]:
            x = self.embed(tokens[:, :-1]) + self.pos[: tokens.shape[1] - 1]
            aux = torch.zeros(())
            for block in self.blocks:
                x, l_aux = block(x)
                aux = aux + l_aux
            logits = self.head(x)
            ce = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
            return ce + AUX_COEF * aux, aux

    torch.manual_seed(seed)
    return TinyMoEGPT()


def batches(rank: int, steps: int) -> list[Any]:
    """This rank's token batches (different on every rank, the same for every ``ep_size``)."""
    import torch

    generator = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator) for _ in range(steps)]


def expert_weights(model: Any, ep_rank: int) -> dict[str, Any]:
    """``{"<layer>.<global expert>.<name>": tensor}`` of this rank's experts."""
    out = {}
    for name, module in model.named_modules():
        if hasattr(module, "deepspeed_experts"):
            for local, expert in enumerate(module.deepspeed_experts):
                index = ep_rank * module.num_local_experts + local
                for pname, p in expert.named_parameters():
                    out[f"{name}.{index}.{pname}"] = p.detach().clone()
    return out


def train(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """Train ``case["steps"]`` steps at ``case["stage"]`` with ``case["ep"]``; losses, balancing
    losses, the expert elements this rank holds and its experts' final weights."""
    import torch

    import shardwise
    from shardwise.comm import groups, mesh
    from shardwise.moe.utils import is_moe_param

    mesh.reset_layout()
    groups.clear_topology()
    torch.manual_seed(7)  # the gate's sampling: the same stream for both runs
    model = build_model(case["ep"])
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "optimizer": OPTIMIZERS[case.get("optimizer", "Adam")],
        "zero_optimization": {"stage": case["stage"]},
        "zero_allow_untested_optimizer": True,  # SGD: element-wise, exact on shards
        "gradient_clipping": case.get("clip", 0.0),
    }
    engine, *_ = shardwise.initialize(model=model, config=config)
    losses, auxes, norms = [], [], []
    for tokens in batches(rank, case["steps"]):
        loss, aux = engine(tokens)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        auxes.append(aux.item())
        norms.append(float(engine.get_global_grad_norm()))
    ep_rank = mesh.current_layout().rank_in("ep") if case["ep"] > 1 else 0
    expert_numel = sum(p.numel() for p in model.parameters() if is_moe_param(p))
    weights = expert_weights(model, ep_rank)
    engine.destroy()
    return {"loss": losses, "aux": auxes, "norm": norms, "expert_numel": expert_numel, "experts": weights}


def save_then_resume(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """Train at ``case["save_ep"]`` and save; resume at ``case["load_ep"]``. Returns the experts
    (by global index) at save and after load, and the next step's loss of both runs."""
    import torch

    import shardwise
    from shardwise.comm import groups, mesh

    def engine_for(ep: int) -> Any:
        mesh.reset_layout()
        groups.clear_topology()
        model = build_model(ep, seed=99)  # other initial weights than the saved ones
        config = {
            "train_micro_batch_size_per_gpu": BATCH,
            "optimizer": OPTIMIZERS["Adam"],
            "zero_optimization": {"stage": case["stage"]},
        }
        engine, *_ = shardwise.initialize(model=model, config=config)
        return engine, model

    def ep_rank(ep: int) -> int:
        return mesh.current_layout().rank_in("ep") if ep > 1 else 0

    data = batches(rank, 4)
    engine, model = engine_for(case["save_ep"])
    for tokens in data[:3]:
        loss, _ = engine(tokens)
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(case["dir"], tag="moe")
    saved = expert_weights(model, ep_rank(case["save_ep"]))
    next_loss = engine(data[3])[0].item()
    engine.destroy()
    engine, model = engine_for(case["load_ep"])
    engine.load_checkpoint(case["dir"], tag="moe", load_optimizer_states=case["optimizer_states"])
    loaded = expert_weights(model, ep_rank(case["load_ep"]))
    resumed_loss = engine(data[3])[0].item()
    engine.destroy()
    torch.distributed.barrier()
    return {"saved": saved, "loaded": loaded, "next_loss": next_loss, "resumed_loss": resumed_loss}


def deepspeed_format_round_trip(rank: int, world: int, case: dict[str, Any]) -> bool:
    """``case["action"]``: ``"save"`` trains 2 steps at EP=2 and saves (shardwise's layout), then rank 0
    writes it in DeepSpeed's MoE layout for EP=2 and EP=1; ``"load"`` resumes from one of those at
    ``case["ep"]`` and saves again (so the test reads both sides back with the same reader)."""
    import torch

    import shardwise
    from shardwise.checkpoint.deepspeed_export import export_deepspeed_stage0
    from shardwise.comm import groups, mesh

    mesh.reset_layout()
    groups.clear_topology()
    model = build_model(case["ep"], seed=5 if case["action"] == "load" else 1234)
    config = {"train_micro_batch_size_per_gpu": BATCH, "optimizer": OPTIMIZERS["Adam"],
              "zero_optimization": {"stage": case.get("stage", 0)}}
    if case.get("bf16"):
        config["bf16"] = {"enabled": True}
    engine, *_ = shardwise.initialize(model=model, config=config)
    root = case["root"]
    if case["action"] == "save":
        torch.manual_seed(7)
        for tokens in batches(rank, 2):
            loss, _ = engine(tokens)
            engine.backward(loss)
            engine.step()
        engine.save_checkpoint(f"{root}/shardwise", tag="t2")
        if rank == 0:
            for ep in (2, 1):
                export_deepspeed_stage0(f"{root}/shardwise", f"{root}/ds_ep{ep}", ep_size=ep)
    else:
        engine.load_checkpoint(case.get("src", f"{root}/ds_ep{case['ep']}"), tag="t2")
        engine.save_checkpoint(case.get("out", f"{root}/back_ep{case['ep']}"), tag="t2")
    engine.destroy()
    torch.distributed.barrier()
    return True
