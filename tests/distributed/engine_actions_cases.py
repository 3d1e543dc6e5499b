"""Per-rank scenarios for test_engine_actions.py: offload_states/reload_states and the gradient
reduction actions (allreduce_gradients, coalesce_grad_reduction, the bucket collectives)."""

from __future__ import annotations

from typing import Any

import torch
from zero_reference import batch, config, make_model

import shardwise
from shardwise.zero.offload_states import OffloadStateType


def _micro(engine: Any, step: int, micro: int, rank: int) -> float:
    x, y = batch(step, micro, rank, 2)
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    return float(loss.detach())


def _snapshot(strategy: Any) -> dict[OffloadStateType, list[torch.Tensor]]:
    strategy.prepare_offload()
    return {kind: [t.detach().clone() for t in tensors] for kind, tensors in strategy.held_states().items()}


def _offload_round(engine: Any, include: list[OffloadStateType] | None) -> dict[str, Any]:
    """Offload ``include``, check where every state lives, reload, check the values came back."""
    strategy = engine.optimizer
    before = _snapshot(strategy)
    optim = strategy.held_states()[OffloadStateType.optim_states]
    original = optim[0].untyped_storage() if optim else None
    engine.offload_states(include=include, device="cpu", pin_memory=True, non_blocking=False)
    held = strategy.held_states()
    offloader = strategy.state_offloader
    moved = {k.value: all(offloader.is_offloaded(t) for t in held[k]) for k in strategy.offloaded_states if held.get(k)}
    optim_moved = original is not None and OffloadStateType.optim_states in strategy.offloaded_states
    freed = original.nbytes() == 0 if original is not None and optim_moved else None
    offloaded = sorted(k.value for k in strategy.offloaded_states)
    engine.reload_states()
    held = strategy.held_states()
    restored = all(
        torch.equal(a, b) and a.dtype == b.dtype
        for k in before
        for a, b in zip(before[k], held[k], strict=True)
    )
    back = not any(offloader.is_offloaded(t) for tensors in held.values() for t in tensors)
    return {
        "moved": moved,
        "freed": freed,
        "regrown": original is None or original.nbytes() > 0,
        "offloaded": offloaded,
        "restored": restored,
        "back": back,
        "after_reload": sorted(k.value for k in strategy.offloaded_states),
    }


def offload_cycle(rank: int, world: int, case: tuple[Any, ...]) -> dict[str, Any]:
    """Two engines train the same batches (accumulation 2); one offloads and reloads its states
    after a step and in the middle of a window (gradients held): the losses and weights are equal.
    ``case``: ``(stage, precision[, zero_optimization extras])``."""
    stage, precision, *extras = case
    torch.set_num_threads(1)
    cfg = config(stage, precision, 2, 2, world, **(extras[0] if extras else {}))
    plain, _, _, _ = shardwise.initialize(model=make_model(0), config=cfg)
    moving, _, _, _ = shardwise.initialize(model=make_model(0), config=cfg)
    losses: dict[str, list[float]] = {"plain": [], "moving": []}
    rounds = []
    for step in range(3):
        for micro in range(2):
            losses["plain"].append(_micro(plain, step, micro, rank))
            losses["moving"].append(_micro(moving, step, micro, rank))
            if step == 1:  # mid-window (gradients held), then after the optimizer step
                rounds.append(_offload_round(moving, None))
    partial = _offload_round(moving, [OffloadStateType.optim_states, OffloadStateType.lp_grads])
    losses["plain"].append(_micro(plain, 3, 0, rank))
    losses["moving"].append(_micro(moving, 3, 0, rank))
    weights_equal = all(
        torch.equal(_whole(a), _whole(b))
        for a, b in zip(plain.module.parameters(), moving.module.parameters(), strict=True)
    )
    refusals = {}
    try:
        moving.offload_states(device="nvme")
    except ValueError as error:
        refusals["nvme"] = str(error)
    try:
        moving.offload_states(include=["activations"])
    except ValueError as error:
        refusals["name"] = str(error)
    if stage >= 2:
        try:
            with moving.coalesce_grad_reduction():
                pass
        except NotImplementedError as error:
            refusals["coalesce"] = str(error)
    return {
        "losses": losses,
        "rounds": rounds,
        "partial": partial,
        "weights_equal": weights_equal,
        "refusals": refusals,
    }


def _whole(param: torch.Tensor) -> torch.Tensor:
    return param.full_tensor() if hasattr(param, "full_tensor") else param.detach()


def reduction_actions(rank: int, world: int, case: str) -> dict[str, Any]:
    """Stage 1, accumulation 1: a backward under no_sync() then allreduce_gradients() (and a second,
    idempotent call), or a coalesce_grad_reduction() block, trains exactly like plain backwards;
    the bucket collectives average and gather over the ranks."""
    torch.set_num_threads(1)
    cfg = config(1, "fp32", 1, 2, world)
    engines = {
        name: shardwise.initialize(model=make_model(0), config=cfg)[0]
        for name in ("plain", "sync", "coalesce")
    }
    losses: dict[str, list[float]] = {name: [] for name in engines}
    for step in range(2):
        for name, engine in engines.items():
            x, y = batch(step, 0, rank, 2)
            if name == "plain":
                loss = engine(x, y)
                engine.backward(loss)
            elif name == "sync":
                with engine.no_sync():
                    loss = engine(x, y)
                    engine.backward(loss)
                engine.allreduce_gradients()
                engine.allreduce_gradients()  # the window is reduced already: nothing more
            else:
                with engine.coalesce_grad_reduction():
                    loss = engine(x, y)
                    engine.backward(loss)
            engine.step()
            losses[name].append(float(loss.detach()))
    params = {name: [p.detach().clone() for p in e.module.parameters()] for name, e in engines.items()}
    same = {
        name: all(torch.equal(a, b) for a, b in zip(params["plain"], params[name], strict=True))
        for name in ("sync", "coalesce")
    }
    # accumulation 2, one block per micro batch: the first block ends before the boundary (its
    # gradients stay local), the second at it (the window is reduced once)
    cfg2 = config(1, "fp32", 2, 2, world)
    windows = {name: shardwise.initialize(model=make_model(0), config=cfg2)[0] for name in ("plain", "coalesce")}
    for step in range(2):
        for micro in range(2):
            for name, engine in windows.items():
                x, y = batch(step, micro, rank, 2)
                if name == "plain":
                    engine.backward(engine(x, y))
                else:
                    with engine.coalesce_grad_reduction():
                        engine.backward(engine(x, y))
                engine.step()
    same["coalesce_gas2"] = all(
        torch.equal(a, b)
        for a, b in zip(windows["plain"].module.parameters(), windows["coalesce"].module.parameters(), strict=True)
    )
    engine = engines["plain"]
    a, b = torch.full((3,), float(rank + 1)), torch.full((2, 2), float(10 * (rank + 1)))
    flat = engine.allreduce_bucket([a, b], None)
    engine.allreduce_no_retain([a, b], None, numel_per_bucket=2)  # two runs: [a], [b]
    rows = engine.sparse_all_gather(torch.arange(rank + 1, dtype=torch.float32) + 10 * rank, None)
    scalars = engine.all_gather_scalar(torch.tensor([rank], dtype=torch.long), None)
    grads = [torch.full((4,), float(rank))]
    engine.buffered_allreduce_fallback(grads=grads)
    refusals = []
    for call in (
        lambda: engine.buffered_allreduce_fallback(),
        lambda: engine.sparse_allreduce(None, None),
        lambda: engine.allreduce_gradients(bucket_size=1000),
    ):
        try:
            call()
        except (NotImplementedError, ValueError) as error:
            refusals.append(str(error))
    return {
        "losses": losses,
        "same": same,
        "flat": flat.tolist(),
        "no_retain": (a.tolist(), b.flatten().tolist()),
        "rows": [r.tolist() for r in rows],
        "scalars": [int(s) for s in scalars],
        "fallback": grads[0].tolist(),
        "refusals": refusals,
    }
