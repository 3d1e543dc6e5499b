"""Per-rank scenarios for test_checkpoint_*.py (module level so the harness can pickle them).

Every scenario runs the real engine (``shardwise.initialize``) at stages 0-3, with and
without optimizer/parameter offload; the full optimizer state is read back through the
optimizer's checkpoint interface (``full_state_dict``, the one the checkpoint format uses).
"""

from __future__ import annotations

import contextlib
import functools
import os
import types
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import shardwise
from shardwise.checkpoint import engine_io
from shardwise.checkpoint.checkpointer import param_names
from shardwise.data import RepeatingLoader
from shardwise.testing.models import GPTConfig, TinyGPT, TokenDataset

TINY = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
LR, BETAS, EPS, WD = 1e-2, (0.9, 0.99), 1e-8, 0.01
SAMPLES = 24  # divisible by 1, 2, 4 ranks times the batch: every topology sees the same global batches


def make_model(seed: int = 0, dropout: float = 0.0) -> TinyGPT:
    torch.manual_seed(seed)
    cfg = GPTConfig(**{**TINY.__dict__, "dropout": dropout})
    return TinyGPT(cfg)


def dataset() -> TokenDataset:
    return TokenDataset(SAMPLES, TINY.block_size, TINY.vocab_size, seed=3)


def config(
    stage: int, world: int, precision: str = "fp32", global_batch: int = 4, **extra: Any
) -> dict[str, Any]:
    micro = max(1, global_batch // world // 2) if world == 1 else global_batch // world
    gas = global_batch // (micro * world)
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD},
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": LR, "warmup_num_steps": 4},
        },
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000},
        "steps_per_print": 1000,
        **extra,
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2}
    return cfg


def build(stage: int, world: int, precision: str = "fp32", seed: int = 0, dropout: float = 0.0, **extra: Any):
    torch.set_num_threads(1)
    model = make_model(seed, dropout)
    engine, _, loader, _ = shardwise.initialize(
        model=model, training_data=dataset(), config=config(stage, world, precision, **extra)
    )
    return engine, RepeatingLoader(loader)


def train(engine: Any, batches: RepeatingLoader, steps: int) -> list[float]:
    """Per optimizer step, the loss averaged over micro batches and ranks (the global mean)."""
    out = []
    gas = engine.gradient_accumulation_steps()
    for _ in range(steps):
        total = 0.0
        for _ in range(gas):
            x, y = next(batches)
            loss = engine(x.to(engine.device), y.to(engine.device))  # (a no-op on the CPU)
            engine.backward(loss)
            engine.step()
            total += loss.item()
        t = torch.tensor([total / gas], dtype=torch.float64)
        dist.all_reduce(t)
        out.append(t.item() / dist.get_world_size())
    return out


def full_optimizer_state(engine: Any) -> dict[str, Any]:
    """The optimizer's whole state by parameter name, as the checkpoint format has it (collective)."""
    return engine_io.optimizer_state(engine.optimizer).full_state_dict(param_names(engine.module))


def full_params(engine: Any) -> dict[str, torch.Tensor]:
    """The module's state, whole (stage-3 DTensors gathered: collective), as fp32 copies."""
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().float().clone()
        for k, v in engine.module.state_dict().items()
    }


# ---------------------------------------------------------------------------- same topology, bit-exact
def resume_is_bit_exact(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """Train 2N steps; versus train N, save, build a fresh engine (other init), load, train N."""
    stage, precision, root = case["stage"], case["precision"], Path(case["dir"])
    extra = case.get("extra", {})
    n = 4
    engine, batches = build(stage, world, precision, seed=0, dropout=0.1, **extra)
    first = train(engine, batches, n)
    engine.save_checkpoint(root, client_state={"note": "hello", "epoch": 1})
    reference = train(engine, batches, n)
    ref_params = full_params(engine)
    ref_state = full_optimizer_state(engine)
    engine.destroy()  # (offload swap files) before a second engine starts in this process

    resumed, batches2 = build(stage, world, precision, seed=1, dropout=0.1, **extra)
    path, client = resumed.load_checkpoint(root)
    unreadable = unreadable_tensors([resumed.optimizer])
    counters = (resumed.global_steps, resumed.global_samples, resumed.skipped_steps, resumed.micro_steps)
    again = train(resumed, batches2, n)
    state = full_optimizer_state(resumed)
    return {
        "first": first,
        "reference": reference,
        "resumed": again,
        "path": path,
        "client": {k: client[k] for k in ("note", "epoch")},
        "counters": counters,
        "params_equal": all(torch.equal(v, full_params(resumed)[k]) for k, v in ref_params.items()),
        "optimizer_equal": all(
            torch.equal(v, state[k]) if torch.is_tensor(v) else v == state[k]
            for k, v in ref_state.items()
            if k != "optim/param_groups"
        ),
        "lr_equal": resumed.get_lr() == engine.get_lr(),
        "scale_equal": resumed.loss_scale == engine.loss_scale,
        "unreadable_after_load": unreadable,
    }


def unreadable_tensors(roots: list[Any], max_objects: int = 200_000) -> list[str]:
    """Tensors reachable from ``roots`` whose ``grad_fn`` or ``grad`` cannot be read, by path.

    Follows object attributes, containers, closures and tensor attributes (as a memory walker
    does). Reading fails for a view made by an autograd function (e.g. ``DTensor.to_local()``)
    whose base was modified in place afterwards (e.g. by a checkpoint load).
    """
    seen: set[int] = set()
    found: list[str] = []
    stack: list[tuple[Any, str]] = [(root, type(root).__name__) for root in roots]
    leaves = (str, bytes, int, float, bool, complex, type(None), type, types.ModuleType, torch.dtype)
    while stack and len(seen) < max_objects:
        obj, path = stack.pop()
        if id(obj) in seen or isinstance(obj, leaves):
            continue
        seen.add(id(obj))
        children: list[tuple[Any, str]] = []
        if isinstance(obj, torch.Tensor):
            try:
                obj.grad_fn  # noqa: B018 (the read is the check)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # reading .grad of a non-leaf tensor warns
                    grad = obj.grad
            except RuntimeError as error:
                found.append(f"{path}: {str(error).splitlines()[0][:120]}")
                continue
            children = [
                (getattr(obj, "_local_tensor", None), f"{path}._local_tensor"),
                (grad, f"{path}.grad"),
            ]
        elif isinstance(obj, dict):
            # (tensor keys are named by position: their repr would read data that swapped-out
            # optimizer state does not have)
            named = [
                (k if isinstance(k, str | int) else f"#{i}", k, v) for i, (k, v) in enumerate(obj.items())
            ]
            children = [(v, f"{path}[{label!r}]") for label, _, v in named]
            children += [(k, f"{path}.key[{label!r}]") for label, k, _ in named]
        elif isinstance(obj, list | tuple | set | frozenset):
            children = [(v, f"{path}[{i}]") for i, v in enumerate(obj)]
        elif isinstance(obj, functools.partial):
            children = [(v, f"{path}.partial") for v in (obj.func, *obj.args, *obj.keywords.values())]
        elif isinstance(obj, types.MethodType):
            children = [(obj.__self__, f"{path}.__self__")]
        elif isinstance(obj, types.FunctionType):
            for cell in obj.__closure__ or ():
                with contextlib.suppress(ValueError):
                    children.append((cell.cell_contents, f"{path}.<closure>"))
        children += [(v, f"{path}.{name}") for name, v in (getattr(obj, "__dict__", None) or {}).items()]
        stack.extend(children)
    return found


# ---------------------------------------------------------------------------- across world sizes and stages
def save_reference(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """At ``world`` ranks and ``case['stage']``: train N, save, train N more (the reference losses)."""
    engine, batches = build(case["stage"], world, case.get("precision", "fp32"), **case.get("extra", {}))
    train(engine, batches, case["n"])
    engine.save_checkpoint(case["dir"])
    _record_state(rank, full_optimizer_state(engine), case["dir"])
    saved = full_params(engine)
    return {"reference": train(engine, batches, case["n"]), "saved_state": saved if rank == 0 else None}


def _record_state(rank: int, state: dict[str, Any], root: str) -> None:
    """Rank 0 keeps the full optimizer state at save time, for exact comparison after loads."""
    if rank == 0:
        torch.save(
            {k: v for k, v in state.items() if k.startswith(("master/", "optim/")) and torch.is_tensor(v)},
            Path(root) / "expected_state.pt",
        )
    dist.barrier()


def _same_state(state: dict[str, Any], root: str) -> bool:
    expected = torch.load(Path(root) / "expected_state.pt")
    return all(torch.equal(state[k].float(), v.float()) for k, v in expected.items())


def load_and_train(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """Load ``case['dir']`` at this world size and stage (0-3), check the state, train N."""
    engine, batches = build(
        case["stage"], world, case.get("precision", "fp32"), seed=5, **case.get("extra", {})
    )
    engine.load_checkpoint(case["dir"])
    same = _same_state(full_optimizer_state(engine), case["dir"])
    return {
        "losses": train(engine, batches, case["n"]),
        "global_steps": engine.global_steps,
        "state_equal": same,
    }


# ---------------------------------------------------------------------------- atomicity and async
def _failing_writes(after: int, action: str) -> Any:
    """Make the checkpoint writer's per-item write fail (raise, or kill the process) after ``after`` items."""
    from shardwise.checkpoint.raw_storage import RawWriter

    original = RawWriter._write_item
    calls = {"n": 0}

    def write_item(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] > after:
            if action == "kill":
                os._exit(17)
            raise OSError("injected: disk full")
        return original(*args, **kwargs)

    RawWriter._write_item = write_item  # type: ignore[method-assign]
    return lambda: setattr(RawWriter, "_write_item", original)


def interrupted_save_keeps_previous(rank: int, world: int, root: str) -> dict[str, Any]:
    """Save A; a save of B raises mid-write on rank 1; A and ``latest`` stay loadable; B is absent."""
    engine, batches = build(2, world)
    train(engine, batches, 2)
    engine.save_checkpoint(root, tag="A")
    saved_a = full_params(engine)
    train(engine, batches, 2)
    restore = _failing_writes(after=3, action="raise") if rank == 1 else (lambda: None)
    error = None
    try:
        engine.save_checkpoint(root, tag="B")
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    finally:
        restore()
    latest = (Path(root) / "latest").read_text()
    has_b = (Path(root) / "B").exists()
    fresh, _ = build(2, world, seed=9)
    path, _ = fresh.load_checkpoint(root)
    return {
        "error": error,
        "latest": latest,
        "has_b": has_b,
        "path": path,
        "restored": all(torch.equal(v, full_params(fresh)[k]) for k, v in saved_a.items()),
        "steps": fresh.global_steps,
    }


def save_then_killed(rank: int, world: int, root: str) -> None:
    """Save A, then die (SIGKILL-like ``os._exit``) in the middle of writing B."""
    engine, batches = build(1, world)
    train(engine, batches, 2)
    engine.save_checkpoint(root, tag="A")
    torch.save(full_params(engine), Path(root) / f"expected_rank{rank}.pt")
    train(engine, batches, 1)
    _failing_writes(after=2, action="kill")
    engine.save_checkpoint(root, tag="B")


def load_after_kill(rank: int, world: int, root: str) -> dict[str, Any]:
    engine, _ = build(1, world, seed=4)
    path, _ = engine.load_checkpoint(root)
    expected = torch.load(Path(root) / f"expected_rank{rank}.pt")
    return {
        "path": path,
        "restored": all(torch.equal(v, full_params(engine)[k]) for k, v in expected.items()),
        "latest": (Path(root) / "latest").read_text(),
    }


def async_save_snapshots(rank: int, world: int, root: str) -> dict[str, Any]:
    """With async_save the checkpoint holds the state at the call, though training goes on."""
    engine, batches = build(2, world, checkpoint={"async_save": True})
    train(engine, batches, 3)
    at_save = full_params(engine)
    engine.save_checkpoint(root)
    after = train(engine, batches, 3)  # runs while the files are written
    engine_io.wait_for_checkpoint(engine)
    fresh, batches2 = build(2, world, seed=7)
    fresh.load_checkpoint(root)
    return {
        "restored": all(torch.equal(v, full_params(fresh)[k]) for k, v in at_save.items()),
        "same_losses": train(fresh, batches2, 3) == after,
        "latest": (Path(root) / "latest").read_text(),
    }


def tag_validation_fails(rank: int, world: int, root: str) -> str:
    engine, _ = build(1, world, checkpoint={"tag_validation": "fail"})
    try:
        engine.save_checkpoint(root, tag=f"rank{rank}")
    except ValueError as exc:
        return str(exc)
    return "no error"


def sixteen_bit_model(rank: int, world: int, root: str) -> dict[str, Any]:
    from shardwise.checkpoint.writers import read_safetensors

    engine, batches = build(2, world, "bf16")
    train(engine, batches, 2)
    ok_pt = engine.save_16bit_model(root)
    ok_st = engine.save_16bit_model(root, "model.safetensors")
    dist.barrier()
    expected = engine.module.state_dict()
    loaded = torch.load(Path(root) / "pytorch_model.bin", weights_only=True)
    st = read_safetensors(Path(root) / "model.safetensors")
    return {
        "ok": ok_pt and ok_st,
        "pt_equal": list(loaded) == list(expected)
        and all(torch.equal(loaded[k], v) for k, v in expected.items()),
        "st_equal": all(torch.equal(st[k], v) and st[k].dtype == torch.bfloat16 for k, v in expected.items()),
    }


# ---------------------------------------------------------------------------- DeepSpeed import
class DsNet(nn.Module):
    """The model of tests/fixtures/make_deepspeed_ckpt.py (same names and shapes)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.norm = nn.LayerNorm(8)
        self.frozen = nn.Linear(8, 8)
        self.out = nn.Linear(8, 3)
        self.register_buffer("offset", torch.linspace(-1.0, 1.0, 3))
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.norm(self.inp(x)))
        h = h + torch.tanh(self.frozen(h))
        return ((self.out(h) + self.offset - y) ** 2).mean()


def ds_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(2, 6, generator=gen), torch.randn(2, 3, generator=gen)


def import_deepspeed(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """Load a DeepSpeed 0.19.8 checkpoint, compare with its recorded values, train 2 more steps."""
    torch.set_num_threads(1)
    torch.manual_seed(123)  # a different init: everything must come from the checkpoint
    net = DsNet()
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 1e-2, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.01},
        },
        "zero_optimization": {"stage": case["into_stage"], "reduce_bucket_size": 200},
    }
    if case.get("universal"):
        cfg["checkpoint"] = {"load_universal": True}
    engine, _, _, _ = shardwise.initialize(
        model=net, model_parameters=[p for p in net.parameters() if p.requires_grad], config=cfg
    )
    path, client = engine.load_checkpoint(case["dir"])
    expected = torch.load(Path(case["dir"]) / "expected.pt")
    state = full_optimizer_state(engine)
    module = engine.module.state_dict()
    checks = {
        "params": all(torch.equal(state[f"master/{n}"], t) for n, t in expected["params"].items()),
        "module": all(torch.equal(module[n], t) for n, t in expected["params"].items()),
        "frozen": all(torch.equal(module[n], t) for n, t in expected["frozen"].items()),
        "buffers": all(torch.equal(module[n], t) for n, t in expected["buffers"].items()),
        "exp_avg": all(torch.equal(state[f"optim/{n}/exp_avg"], t) for n, t in expected["exp_avg"].items()),
        "exp_avg_sq": all(
            torch.equal(state[f"optim/{n}/exp_avg_sq"], t) for n, t in expected["exp_avg_sq"].items()
        ),
    }
    losses = []
    for step in range(engine.global_steps, engine.global_steps + 2):
        loss = engine(*ds_batch(step, rank))
        engine.backward(loss)
        engine.step()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / world)
    return {
        "checks": checks,
        "path": path,
        "global_steps": engine.global_steps,
        "client_has_ds_config": "ds_config" in client,
        "losses": losses,
        "expected_losses": expected["mean_losses_after"],
    }


def load_and_train_or_save(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """One spawn, many cases: save a reference or load and train."""
    if case["op"] == "save":
        return save_reference(rank, world, case)
    return load_and_train(rank, world, case)


def api_semantics(rank: int, world: int, root: str) -> dict[str, Any]:
    """DeepSpeed's load_checkpoint options, strictness, save_latest, frozen exclusion, info and export."""
    from shardwise.checkpoint.export import checkpoint_info, load_full_state_dict

    out: dict[str, Any] = {}
    engine, batches = build(2, world)
    out["no_latest"] = engine.load_checkpoint(root)
    train(engine, batches, 3)
    engine.save_checkpoint(root, tag="kept")
    engine.save_checkpoint(root, tag="side", save_latest=False)
    out["latest"] = (Path(root) / "latest").read_text()
    saved = full_params(engine)
    lr_saved = engine.get_lr()

    fresh, _ = build(2, world, seed=3)
    lr_fresh = fresh.get_lr()
    fresh.load_checkpoint(root, load_module_only=True)
    out["module_only"] = {
        "params": all(torch.equal(v, full_params(fresh)[k]) for k, v in saved.items()),
        "steps": fresh.global_steps,
        "lr_untouched": fresh.get_lr() == lr_fresh,
        "scheduler": fresh.lr_scheduler.last_batch_iteration,
    }
    fresh2, _ = build(2, world, seed=3)
    fresh2.load_checkpoint(root, load_optimizer_states=False, load_lr_scheduler_states=False)
    out["no_optimizer"] = {
        "params": all(torch.equal(v, full_params(fresh2)[k]) for k, v in saved.items()),
        "state_empty": len(fresh2.optimizer.optimizer.state) == 0,
        "steps": fresh2.global_steps,
        "lr_untouched": fresh2.get_lr() == lr_fresh != lr_saved,
    }
    # a model with one more buffer: strict loading names it, non-strict loads the rest
    extra, _ = build(2, world, seed=3)
    extra.module.register_buffer("extra_buffer", torch.zeros(2))
    try:
        extra.load_checkpoint(root)
        out["strict_error"] = None
    except RuntimeError as exc:
        out["strict_error"] = str(exc)
    extra.load_checkpoint(root, load_module_strict=False)
    out["non_strict_params"] = all(torch.equal(v, full_params(extra)[k]) for k, v in saved.items())

    # frozen parameters excluded from the save: export leaves them out, a strict load still works
    torch.manual_seed(0)
    frozen_model = make_model()
    frozen_model.wpe.requires_grad_(False)
    frozen_engine, _, _, _ = shardwise.initialize(
        model=frozen_model,
        model_parameters=[p for p in frozen_model.parameters() if p.requires_grad],
        config=config(2, world),
    )
    frozen_engine.save_checkpoint(Path(root) / "frozen", exclude_frozen_parameters=True)
    frozen_engine.load_checkpoint(Path(root) / "frozen")
    exported = load_full_state_dict(Path(root) / "frozen")
    out["frozen_excluded"] = "wpe.weight" not in exported and "wte.weight" in exported
    info = checkpoint_info(root)
    out["info"] = [(t["tag"], t["zero_stage"], t["world_size"], t["global_steps"]) for t in info["tags"]]
    full = load_full_state_dict(root)
    out["export_equal"] = list(full) == list(saved) and all(torch.equal(full[k], v) for k, v in saved.items())
    return out


def io_case(rank: int, world: int, case: dict[str, Any]) -> Any:
    """Dispatch for test_checkpoint_io (one spawn for several behaviours)."""
    functions = {
        "interrupted": interrupted_save_keeps_previous,
        "async": async_save_snapshots,
        "tag_fail": tag_validation_fails,
        "16bit": sixteen_bit_model,
        "api": api_semantics,
    }
    return functions[case["name"]](rank, world, case["dir"])
