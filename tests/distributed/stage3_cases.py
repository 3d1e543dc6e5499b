"""Per-rank scenarios for test_stage3.py (module level so the harness can pickle them).

Training reuses zero_reference's model, data and config; stage 3's full fp32 masters come
from ``Stage3Optimizer.full_fp32_parameters`` (there are no flat groups to read). Every
scenario is one case of a single spawn; :func:`run_case` dispatches on ``case["kind"]``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from stage3_precision_cases import float_target
from torch import nn
from zero_reference import TINY, _micro_batch, batch, config, make_model

import shardwise
from shardwise.testing.models import GPTConfig, TinyGPT

NVME = "<nvme_path>"
"""A case's placeholder for a scratch directory (NVMe swap files, a save folder): the test module's
fixture puts a real path in its place with :func:`with_path` (case lists are built at import)."""


def with_path(value: Any, path: str) -> Any:
    """``value`` with every :data:`NVME` placeholder, in nested dicts too, replaced by ``path``."""
    if value == NVME:
        return path
    if isinstance(value, dict):
        return {k: with_path(v, path) for k, v in value.items()}
    return value

def _config(case: dict[str, Any], world: int) -> dict[str, Any]:
    zero = {"stage3_param_persistence_threshold": 0, **case.get("zero", {})}
    return config(
        case["stage"],
        case["precision"],
        case["gas"],
        case["micro_batch"],
        world,
        clip=case.get("clip", 0.0),
        **zero,
    )


def _train(engine: Any, rank: int, case: dict[str, Any]) -> tuple[dict[Any, float], list[float | None]]:
    losses = {}
    norms = []
    for step in range(case["steps"]):
        for micro in range(case["gas"]):
            x, y = _micro_batch(case, step, micro, rank)
            loss = engine(x.to(engine.device), y.to(engine.device))
            losses[(step, micro, rank)] = loss.item()
            engine.backward(loss)
            engine.step()
        norms.append(engine.get_global_grad_norm())
    return losses, norms


def train(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """Train like zero_reference.rank_train at stage 3; losses, norms and full masters."""
    torch.set_num_threads(1)
    start = time.perf_counter()
    model = make_model()
    engine, optimizer, _, _ = shardwise.initialize(
        model=model, model_parameters=model.parameters(), config=_config(case, world)
    )
    losses, norms = _train(engine, rank, case)
    out = {
        "losses": losses,
        "params": [p.cpu() for p in optimizer.full_fp32_parameters()],
        "steps": engine.global_steps,
        "skipped": engine.skipped_steps,
        "norms": norms,
        "optimizer": type(optimizer).__name__,
        "inner": type(optimizer.optimizer).__name__,
        "units": list(optimizer.record.unit_names),
        "n_sharded": len(optimizer.record.sharded),
        "n_replicated": len(optimizer.record.replicated),
        "tied": engine.module.lm_head.weight is engine.module.wte.weight,
        "breakdown": optimizer.memory_breakdown(),
        "seconds": time.perf_counter() - start,
    }
    optimizer.close()
    return out


# --------------------------------------------------------------------------- LoRA, frozen
class LoRALinear(nn.Module):
    """A frozen base linear plus a trainable low-rank adapter (B starts at zero) and a
    one-row shift (FSDP2 gives the second rank an empty shard of it)."""

    def __init__(self, base: nn.Linear, rank: int = 4) -> None:
        super().__init__()
        self.base = base
        self.lora_a = nn.Linear(base.in_features, rank, bias=False)
        self.lora_b = nn.Linear(rank, base.out_features, bias=False)
        self.shift = nn.Parameter(torch.zeros(1, base.out_features))
        nn.init.zeros_(self.lora_b.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_b(self.lora_a(x)) + self.shift


def lora_model() -> TinyGPT:
    model = make_model()
    for p in model.parameters():
        p.requires_grad_(False)
    for block in model.blocks:
        block.attn.qkv = LoRALinear(block.attn.qkv)
        block.mlp[0] = LoRALinear(block.mlp[0])
    return model


def lora(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """A frozen base with adapters: only the adapters change, and the loss goes down."""
    torch.set_num_threads(1)
    model = lora_model()
    # every parameter starts from its value rounded through the compute dtype (the masters
    # too), and frozen ones are kept in it: "changed" means changed from that
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[case["precision"]]
    before = {n: p.detach().to(dtype).float() for n, p in model.named_parameters()}
    cfg = config(3, case["precision"], 1, 2, world, stage3_param_persistence_threshold=0)
    cfg["optimizer"]["params"]["lr"] = 3e-2
    engine, optimizer, _, _ = shardwise.initialize(model=model, config=cfg)
    losses = []
    x, y = batch(0, 0, rank, 2)
    for _ in range(case["steps"]):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    after = dict(zip([n for n, _ in engine.module.named_parameters()], optimizer.full_fp32_parameters()))
    changed = {n: not torch.equal(after[n], before[n]) for n in before}
    trainable = {n: p.requires_grad for n, p in engine.module.named_parameters()}
    out = {
        "losses": losses,
        "changed": changed,
        "trainable": trainable,
        "n_masters": len(optimizer.masters) + len(optimizer.replicated.masters),
        "empty_shards": sum(1 for m in optimizer.masters if m.numel() == 0),
        "breakdown": optimizer.memory_breakdown(),
    }
    optimizer.close()
    return out


# --------------------------------------------------------------------------- tied + resized embeddings
def _resize_embeddings(model: TinyGPT, new_vocab: int) -> None:
    """``resize_token_embeddings``: a new, larger embedding keeping the old rows, head re-tied."""
    old = model.wte
    new = nn.Embedding(new_vocab, old.embedding_dim)
    with torch.no_grad():
        new.weight[: old.num_embeddings].copy_(old.weight)
    model.wte = new
    model.lm_head = nn.Linear(old.embedding_dim, new_vocab, bias=False)
    model.lm_head.weight = model.wte.weight


def resized(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """Embeddings replaced before initialize (optionally under zero.Init): tie, shape, old rows kept."""
    torch.set_num_threads(1)
    cfg = config(3, "fp32", 1, 2, world, stage3_param_persistence_threshold=0)
    if case.get("under_init"):
        with shardwise.zero.Init(config_dict_or_path=cfg):
            model = make_model()
        with shardwise.zero.GatheredParameters([model.wte.weight], modifier_rank=None):
            old_rows = model.wte.weight.detach().clone()
            _resize_embeddings(model, TINY.vocab_size + 8)  # built outside Init: whole
    else:
        model = make_model()
        old_rows = model.wte.weight.detach().clone()
        _resize_embeddings(model, TINY.vocab_size + 8)
    engine, optimizer, _, _ = shardwise.initialize(model=model, config=cfg)
    names = [n for n, _ in engine.module.named_parameters()]
    start = dict(zip(names, optimizer.full_fp32_parameters()))
    x, y = batch(0, 0, rank, 2)
    losses = []
    for _ in range(2):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    module = engine.module
    with shardwise.zero.GatheredParameters([module.wte.weight, module.lm_head.weight]):
        gathered_same = module.wte.weight is module.lm_head.weight
        full = module.wte.weight.detach().clone()
    out = {
        "tied": module.lm_head.weight is module.wte.weight,
        "gathered_tied": gathered_same,
        "shape": tuple(full.shape),
        "old_rows_kept": torch.equal(start["wte.weight"][: TINY.vocab_size], old_rows.float()),
        "head_in_names": "lm_head.weight" in names,
        "losses": losses,
    }
    optimizer.close()
    return out


# --------------------------------------------------------------------------- zero.Init
def init_placeholders(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """Under Init: meta placeholders with full shapes and DeepSpeed attributes; leaf values
    are exactly those of a normal construction; gathering and modifying works before initialize."""
    torch.set_num_threads(1)
    torch.manual_seed(3)
    plain = nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 3))
    torch.manual_seed(3)
    with shardwise.zero.Init():
        built = nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 3))
    params = list(built.parameters())
    out: dict[str, Any] = {
        "meta": all(p.device.type == "meta" for p in params),
        "shapes": [tuple(p.shape) for p in params],
        "ds_numel": [int(p.ds_numel) for p in params],
        "local_rows": [int(p.ds_tensor.shape[0]) for p in params],
        "status": [p.ds_status.name for p in params],
    }
    with shardwise.zero.GatheredParameters(params):
        out["gathered_equal"] = all(torch.equal(a, b) for a, b in zip(built.parameters(), plain.parameters()))
        out["status_inside"] = [p.ds_status.name for p in built.parameters()]
        out["ids_inside"] = [int(p.ds_id) for p in built.parameters()] == [int(p.ds_id) for p in params]
        built[0].weight.data.fill_(7.0)  # discarded: no modifier rank
    with shardwise.zero.GatheredParameters(params, modifier_rank=1):
        if rank == 1:
            built[0].bias.data.fill_(5.0)
    with shardwise.zero.GatheredParameters(params):
        out["discarded"] = torch.equal(built[0].weight, plain[0].weight)
        out["kept_from_rank1"] = bool((built[0].bias == 5.0).all())
    out["meta_again"] = all(p.device.type == "meta" for p in built.parameters())
    out["status_after"] = [p.ds_status.name for p in built.parameters()]
    return out


def init_then_train(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """A TinyGPT built under Init, loaded with the reference weights through
    GatheredParameters(modifier_rank=0), trains exactly like the reference."""
    torch.set_num_threads(1)
    cfg = _config(case, world)
    with shardwise.zero.Init(config_dict_or_path=cfg):
        model = TinyGPT(TINY)
    assert model.lm_head.weight is model.wte.weight  # the tie made after attaching is kept
    placeholder_bytes = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in model.parameters())
    reference = make_model().state_dict()
    with shardwise.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
        if rank == 0:
            model.load_state_dict(reference)
    engine, optimizer, _, _ = shardwise.initialize(model=model, config=cfg)
    losses, _ = _train(engine, rank, case)
    out = {
        "losses": losses,
        "params": optimizer.full_fp32_parameters(),
        "placeholder_bytes": placeholder_bytes,
        "full_bytes": sum(v.numel() * 4 for k, v in reference.items() if k != "lm_head.weight"),
        "tied": engine.module.lm_head.weight is engine.module.wte.weight,
    }
    optimizer.close()
    return out


# --------------------------------------------------------------------------- after initialize
def gathered_after_initialize(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """GatheredParameters on sharded and on unsharded (persistent) parameters."""
    torch.set_num_threads(1)
    model = make_model()
    cfg = config(3, "bf16", 1, 2, world, stage3_param_persistence_threshold=100)
    engine, optimizer, _, _ = shardwise.initialize(model=model, config=cfg)
    module = engine.module
    qkv = module.blocks[0].attn.qkv.weight
    ln = module.blocks[0].ln1.weight  # 32 elements: unsharded
    out: dict[str, Any] = {
        "qkv_sharded": hasattr(qkv, "device_mesh"),
        "ln_sharded": hasattr(ln, "device_mesh"),
        "status_before": (qkv.ds_status.name, ln.ds_status.name),
    }
    with shardwise.zero.GatheredParameters([qkv, ln], modifier_rank=0):
        inside = module.blocks[0].attn.qkv.weight
        out["status_inside"] = (inside.ds_status.name, qkv.ds_status.name, inside.ds_id == qkv.ds_id)
        out["inside_plain"] = not hasattr(inside, "device_mesh") and tuple(inside.shape) == (96, 32)
        if rank == 0:
            inside.data.fill_(0.25)
            module.blocks[0].ln1.weight.data.fill_(2.0)
    out["restored"] = module.blocks[0].attn.qkv.weight is qkv
    out["status_after"] = module.blocks[0].attn.qkv.weight.ds_status.name
    full = optimizer.full_fp32_parameters()
    names = [n for n, _ in module.named_parameters()]
    values = dict(zip(names, full))
    out["qkv_all"] = bool((values["blocks.0.attn.qkv.weight"] == 0.25).all())
    out["ln_all"] = bool((values["blocks.0.ln1.weight"] == 2.0).all())
    out["ln_module"] = bool((module.blocks[0].ln1.weight.float() == 2.0).all())
    x, y = batch(0, 0, rank, 2)
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    out["finite"] = bool(torch.isfinite(loss).item())
    optimizer.close()
    return out


def save_16bit(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """``engine.save_16bit_model`` at stage 3: nothing (False) when
    stage3_gather_16bit_weights_on_model_save is false; full bf16 weights when true."""
    from shardwise.checkpoint.writers import read_safetensors

    torch.set_num_threads(1)
    results: dict[bool, Any] = {}
    for flag in (False, True):
        model = make_model()
        cfg = config(
            3,
            "bf16",
            1,
            2,
            world,
            stage3_gather_16bit_weights_on_model_save=flag,
            stage3_param_persistence_threshold=0,
        )
        engine, optimizer, _, _ = shardwise.initialize(model=model, config=cfg)
        root = Path(case["dir"]) / f"sixteen_{flag}"
        ok = engine.save_16bit_model(str(root), "model.safetensors")
        masters = dict(
            zip([n for n, _ in engine.module.named_parameters()], optimizer.full_fp32_parameters())
        )
        dist.barrier()
        written = root / "model.safetensors"
        state = read_safetensors(written) if written.exists() else None
        results[flag] = {
            "ok": ok,
            "file": state is not None,
            "sharded": any(hasattr(p, "full_tensor") for p in engine.module.parameters()),
            "checkpoint_instead": (root / "latest").exists(),
        }
        if state is not None:
            results[flag].update(
                keys=sorted(state),
                dtypes=sorted({str(v.dtype) for v in state.values()}),
                match=all(torch.equal(state[k], v.to(torch.bfloat16)) for k, v in masters.items()),
            )
        optimizer.close()
    return results


class _ExternalHead(nn.Module):
    """The head uses the embedding's weight without registering it (needs an external registration)."""

    def __init__(self, embed: nn.Embedding) -> None:
        super().__init__()
        self.embed = [embed]  # not a submodule: only used in forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.embed[0].weight)


class _ExternalNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(16, 8)
        self.mid = nn.Linear(8, 8)
        self.head = _ExternalHead(self.embed)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.mid(self.embed(idx)))
        return F.cross_entropy(logits.reshape(-1, 16), targets.reshape(-1))


def external_parameter(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """With the embedding a shard unit of its own, its use by the head needs registration."""
    torch.set_num_threads(1)
    out = {}
    for register in (False, True):
        net = _ExternalNet()
        if register:
            shardwise.zero.register_external_parameter(net.head, net.embed.weight)
        cfg = config(
            3,
            "fp32",
            1,
            2,
            world,
            stage3_param_persistence_threshold=0,
            leaf_module={"names": ["embed"]},
            stage3_max_live_parameters=0,  # reshard every unit after its forward
        )
        engine, optimizer, _, _ = shardwise.initialize(model=net, config=cfg)
        idx = torch.randint(0, 16, (2, 5), generator=torch.Generator().manual_seed(rank))
        try:
            loss = engine(idx, idx)
            engine.backward(loss)
            engine.step()
            out[register] = {"ok": True, "units": list(optimizer.record.unit_names)}
        except Exception as exc:  # the unregistered case fails inside the forward
            out[register] = {
                "ok": False,
                "error": type(exc).__name__,
                "units": list(optimizer.record.unit_names),
            }
        optimizer.close()
        dist.barrier()
    return out


# --------------------------------------------------------------------------- step semantics
def overflow(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """fp16: an inf gradient on rank 1 only makes every rank skip (hysteresis 2: 16, 16, 8)."""
    torch.set_num_threads(1)
    model = make_model()
    cfg = config(3, "fp16", 1, 2, world, stage3_param_persistence_threshold=100)
    cfg["fp16"] = {"enabled": True, "initial_scale_power": 4, "hysteresis": 2}
    engine, optimizer, _, _ = shardwise.initialize(model=model, config=cfg)
    record = []
    for step in range(4):
        x, y = batch(step, 0, rank, 2)
        before = optimizer.full_fp32_parameters()
        loss = engine(x, y)
        if step in (1, 2) and rank == 1:
            loss = loss * float("inf")
        engine.backward(loss)
        engine.step()
        after = optimizer.full_fp32_parameters()
        record.append(
            {
                "applied": engine.was_step_applied(),
                "changed": any(not torch.equal(a, b) for a, b in zip(before, after)),
                "scale": engine.loss_scale,
                "norm": engine.get_global_grad_norm(),
            }
        )
    optimizer.close()
    return {"record": record}


class _Sometimes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.frozen = nn.Linear(8, 8)
        self.used = nn.Linear(8, 4)
        self.sometimes = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, use_all: bool) -> torch.Tensor:
        h = self.frozen(x)
        out = self.used(h)
        if use_all:
            out = out + self.sometimes(h)
        return out.pow(2).mean()


def unused_and_averaging(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """Frozen params stay; a param without gradient in a step still steps (grad 0); every
    averaging recipe gives the same update (sum doubles it at W=2)."""
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    variants = {
        "default": {},
        "prescale": {"prescale_gradients": True},
        "predivide": {"gradient_predivide_factor": 2.0},
        "comm_bf16": {"communication_data_type": "bf16"},
    }
    for name, extra in variants.items():
        net = _Sometimes()
        net.frozen.requires_grad_(False)
        cfg = {**config(3, "fp32", 1, 2, world, stage3_param_persistence_threshold=0), **extra}
        cfg["optimizer"] = {"type": "SGD", "params": {"lr": 0.5}}
        cfg["zero_allow_untested_optimizer"] = True
        engine, optimizer, _, _ = shardwise.initialize(model=net, config=cfg)
        names = [n for n, _ in engine.module.named_parameters()]
        start = dict(zip(names, optimizer.full_fp32_parameters()))
        gen = torch.Generator().manual_seed(rank)
        for step in range(2):
            loss = engine(torch.randn(4, 8, generator=gen), step == 0)
            engine.backward(loss)
            engine.step()
        end = dict(zip(names, optimizer.full_fp32_parameters()))
        out[name] = {n: (end[n] - start[n]).reshape(-1).tolist() for n in names}
        optimizer.close()
    return out


# --------------------------------------------------------------------------- memory
def memory(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """Model-state bytes measured after the second step's backward (state, grads and params all
    exist), next to the plan for the same model and config."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    shape = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=4, n_embd=96, qkv_bias=False)
    model = TinyGPT(shape)
    numel = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    plan = shardwise.zero.estimate_model_states_memory(
        model,
        3,
        world,
        precision=case["precision"],
        offload_optimizer=case.get("offload_optimizer", {}).get("device", "none"),
        offload_param=case.get("offload_param", {}).get("device", "none"),
        offload_ratio=case.get("offload_optimizer", {}).get("ratio", 1.0),
        persistence_threshold=case.get("persistence", 0),
    )
    zero: dict[str, Any] = {"stage3_param_persistence_threshold": case.get("persistence", 0)}
    for key in ("offload_optimizer", "offload_param"):
        if key in case:
            zero[key] = case[key]
    cfg = config(3, case["precision"], 1, 2, world, **zero)
    engine, optimizer, _, _ = shardwise.initialize(model=model, config=cfg)
    gen = torch.Generator().manual_seed(rank)
    for step in range(2):
        idx = torch.randint(0, shape.vocab_size, (2, shape.block_size), generator=gen)
        loss = engine(idx, idx)
        engine.backward(loss)
        if step == 1:
            measured = optimizer.memory_breakdown()
        engine.step()
    out = {
        "measured": measured,
        "plan": {
            "params": plan.params,
            "grads": plan.grads,
            "optimizer": plan.optimizer,
            "offloaded_host": plan.offloaded_host,
            "offloaded_nvme": plan.offloaded_nvme,
        },
        "numel": numel,
    }
    optimizer.close()
    return out


SCENARIOS = {
    "train": train,
    "lora": lora,
    "resized": resized,
    "init_placeholders": init_placeholders,
    "init_then_train": init_then_train,
    "gathered_after_initialize": gathered_after_initialize,
    "save_16bit": save_16bit,
    "external_parameter": external_parameter,
    "memory": memory,
    "overflow": overflow,
    "unused_and_averaging": unused_and_averaging,
    "float_target": float_target,
}


def run_case(rank: int, world: int, case: dict[str, Any]) -> Any:
    """Dispatch one case to its scenario."""
    if case.get("kind") == "zero_reference":
        from zero_reference import rank_train

        return rank_train(rank, world, case)
    return SCENARIOS[case.get("kind", "train")](rank, world, case)
