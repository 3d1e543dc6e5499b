"""Rank-side case of the folded AutoEP + AutoTP checkpoint test: the folded model of
``autoep_folding_cases`` saved, resumed into a fresh engine, and refused without its layout record
or with another expert-parallel size."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _fresh(stage: int, tp: int, ep: int) -> Any:
    from autoep_folding_cases import _config, build_model

    import shardwise
    from shardwise.comm import groups, mesh

    mesh.reset_layout()
    groups.clear_topology()
    engine, *_ = shardwise.initialize(model=build_model(), config=_config(stage, tp, ep))
    return engine


def _params(engine: Any) -> dict[str, Any]:
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _refusal(engine: Any, root: Path) -> str:
    try:
        engine.load_checkpoint(str(root), tag="folded")
    except RuntimeError as error:
        return str(error)
    return ""


def save_resume_refuse(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """Train and save folded (tp=2, ep=2, ZeRO 0), resume into a fresh engine and step both; then load
    with the model files' records removed, and into an ep=4 run: the refusals' messages."""
    import torch
    import torch.distributed as dist
    from autoep_folding_cases import _run

    root = Path(case["dir"])
    tp, ep, stage = 2, 2, 0
    engine, _ = _run(rank, stage, tp, ep, rank // tp, world // tp)
    engine.save_checkpoint(str(root), tag="folded")
    saved = _params(engine)
    files = sorted(p.name for p in (root / "folded").glob("*.pt"))
    resumed = _fresh(stage, tp, ep)
    differed = any(not torch.equal(saved[n], p) for n, p in _params(resumed).items())
    resumed.load_checkpoint(str(root), tag="folded")
    equal_after_load = all(torch.equal(saved[n], p) for n, p in _params(resumed).items())
    generator = torch.Generator().manual_seed(7 + rank // tp)
    x, target = torch.randn(2, 5, 16, generator=generator), torch.randn(2, 5, 8, generator=generator)
    for each in (engine, resumed):  # the same next step from the original and the resumed engine
        each.backward(((each(x) - target) ** 2).mean())
        each.step()
    equal_after_step = all(torch.equal(p, q) for p, q in zip(engine.module.parameters(), resumed.module.parameters()))
    engine.destroy()
    resumed.destroy()
    if rank == 0:
        for path in (root / "folded").glob("mp_rank_*_model_states.pt"):
            state = torch.load(path, weights_only=True)
            state.pop("folding")
            torch.save(state, path)
    dist.barrier()
    stripped = _fresh(stage, tp, ep)
    missing = _refusal(stripped, root)
    stripped.destroy()
    wider = _fresh(stage, tp, 4)
    other_layout = _refusal(wider, root)
    wider.destroy()
    return {"files": files, "differed": differed, "equal_after_load": equal_after_load,
            "equal_after_step": equal_after_step, "missing": missing, "other_layout": other_layout}
