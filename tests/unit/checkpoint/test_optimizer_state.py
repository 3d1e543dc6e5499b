"""The optimizer's checkpoint adapter on hand-made state layouts, in one process (no process group).

Flat layouts stand for ZeRO stages 0-2 (one "rank" holding every piece, cut at arbitrary
bucket boundaries), whole layouts for a plain torch optimizer; files are written and read
with DCP without a process group, so a save in one layout is loaded into another.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from shardwise.checkpoint import dcp_io
from shardwise.checkpoint.engine_io import optimizer_state
from shardwise.checkpoint.optimizer_state import OptimizerState, install_optimizer_state
from shardwise.checkpoint.param_state import ParamOptimizerState
from shardwise.zero.state_layout import FlatPiece, Holding, ParamPlace, StateLayout
from shardwise.zero.strategy import ZeroStrategy


def _model(seed: int, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)).to(dtype)


def _names(model: torch.nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


def _flat_layout(model: torch.nn.Module, cuts: Sequence[int], lr: float) -> StateLayout:
    """Separate fp32 masters of ``model``'s parameters, concatenated and cut at ``cuts`` into
    the tensors an AdamW steps (as a ZeRO flat group cuts buckets)."""
    params = list(model.parameters())
    full = torch.cat([p.detach().float().reshape(-1) for p in params])
    bounds = [0, *cuts, full.numel()]
    masters = [full[a:b].clone() for a, b in itertools.pairwise(bounds)]
    places, offset = [], 0
    for param in params:
        pieces = []
        for master, a, b in zip(masters, bounds, bounds[1:]):
            lo, hi = max(a, offset), min(b, offset + param.numel())
            if lo < hi:
                pieces.append(FlatPiece(lo - offset, hi - offset, master, lo - a))
        places.append(ParamPlace(param, tuple(param.shape), Holding.FLAT, True, pieces=tuple(pieces)))
        offset += param.numel()

    def params_from_masters() -> None:
        with torch.no_grad():
            for place in places:
                for piece in place.pieces:
                    place.param.view(-1)[piece.start : piece.stop] = piece.take()

    def masters_from_params() -> None:
        with torch.no_grad():
            for place in places:
                for piece in place.pieces:
                    piece.take().copy_(place.param.reshape(-1)[piece.start : piece.stop])

    return StateLayout(
        optimizer=torch.optim.AdamW(masters, lr=lr),
        optimizer_name="AdamW",
        places=tuple(places),
        groups=(tuple(range(len(places))),),
        params_from_masters=params_from_masters,
        masters_from_params=masters_from_params,
        device=torch.device("cpu"),
    )


def _train(optimizer: torch.optim.Optimizer, steps: int = 2) -> None:
    generator = torch.Generator().manual_seed(7)
    for _ in range(steps):
        for group in optimizer.param_groups:
            for tensor in group["params"]:
                tensor.grad = torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype)
        optimizer.step()


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Equal full states: every tensor bit for bit, every scalar, every hyperparameter."""
    if sorted(a) != sorted(b):
        return False
    return all(torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a)


def _save(items: dict[str, Any], path: Any) -> None:
    with warnings.catch_warnings(action="ignore"):
        dcp_io.save(items, path, no_dist=True)


def _load(targets: dict[str, Any], path: Any) -> None:
    with warnings.catch_warnings(action="ignore"):
        dcp_io.load(targets, path, no_dist=True)


def test_flat_state_saved_in_one_cut_loads_into_another_bit_for_bit(tmp_path):
    model = _model(0, torch.bfloat16)
    saving = _flat_layout(model, cuts=[5, 17], lr=0.1)
    _train(saving.optimizer)
    saving.params_from_masters()
    names = _names(model)
    state = OptimizerState(saving)
    items = state.sharded_state_dict(names)
    masters = sorted(k for k in items if k.startswith("master/"))
    assert masters == sorted(f"master/{n}" for n in names.values())
    assert isinstance(items["optim/0.weight/exp_avg"], dcp_io.FlatShards)
    assert items["optim/param_groups"][0]["shardwise_param_names"] == list(names.values())
    _save(items, tmp_path)

    other = _model(1, torch.bfloat16)
    loading = _flat_layout(other, cuts=[3], lr=0.5)  # other buckets, other values, other lr
    targets, finish = OptimizerState(loading).sharded_load(
        _names(other), dcp_io.StreamingReader(tmp_path).entries, with_state=True
    )
    assert "model/0.weight" not in targets  # the fp32 values come from the masters
    _load(targets, tmp_path)
    finish(targets)

    assert _same(OptimizerState(loading).full_state_dict(_names(other)), state.full_state_dict(names))
    assert loading.optimizer.param_groups[0]["lr"] == 0.1
    for mine, theirs in zip(model.parameters(), other.parameters()):
        assert torch.equal(mine.detach(), theirs.detach())  # parameters followed their masters


def test_masters_only_load_keeps_the_optimizer_state_and_hyperparameters(tmp_path):
    model = _model(0, torch.bfloat16)
    saving = _flat_layout(model, cuts=[9], lr=0.1)
    _train(saving.optimizer)
    _save(OptimizerState(saving).sharded_state_dict(_names(model)), tmp_path)
    other = _model(1, torch.bfloat16)
    loading = _flat_layout(other, cuts=[9], lr=0.5)
    targets, finish = OptimizerState(loading).sharded_load(
        _names(other), dcp_io.StreamingReader(tmp_path).entries, with_state=False
    )
    assert all(k.startswith("master/") for k in targets)
    _load(targets, tmp_path)
    finish(targets)
    assert loading.optimizer.state == {} and loading.optimizer.param_groups[0]["lr"] == 0.5
    loaded, saved = (layout.optimizer.param_groups[0]["params"] for layout in (loading, saving))
    assert all(torch.equal(a, b) for a, b in zip(loaded, saved))


def test_flat_and_whole_layouts_exchange_full_state_both_ways():
    model = _model(0)
    flat = _flat_layout(model, cuts=[7, 20], lr=0.1)
    _train(flat.optimizer)
    flat_full = OptimizerState(flat).full_state_dict(_names(model))

    whole_model = _model(1)
    whole = ParamOptimizerState(torch.optim.AdamW(whole_model.parameters(), lr=0.5))
    whole.load_full_state_dict(flat_full, _names(whole_model))
    assert _same(whole.full_state_dict(_names(whole_model)), flat_full)
    assert whole.optimizer.param_groups[0]["lr"] == 0.1

    _train(whole.optimizer, steps=1)
    whole_full = whole.full_state_dict(_names(whole_model))
    back_model = _model(2)
    back = _flat_layout(back_model, cuts=[1], lr=0.5)
    OptimizerState(back).load_full_state_dict(whole_full, _names(back_model))
    assert _same(OptimizerState(back).full_state_dict(_names(back_model)), whole_full)


def test_weights_only_loads_refresh_the_masters_from_the_parameters():
    model = _model(0)
    layout = _flat_layout(model, cuts=[4], lr=0.1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    OptimizerState(layout).refresh_masters_from_params()
    full = OptimizerState(layout).full_state_dict(_names(model))
    assert all(torch.equal(full[f"master/{n}"], p.detach()) for n, p in model.named_parameters())


def test_engine_optimizers_get_their_adapter_from_their_description():
    model = _model(0)
    described = _flat_layout(model, cuts=[4], lr=0.1)

    class Strategy(ZeroStrategy):  # only what a checkpoint asks of it
        def state_layout(self) -> StateLayout:
            return described

    assert optimizer_state(None) is None
    assert optimizer_state(Strategy()).layout is described  # type: ignore[union-attr]
    plain = optimizer_state(torch.optim.SGD(model.parameters(), lr=0.1))
    assert isinstance(plain, ParamOptimizerState) and plain.optimizer_name == "SGD"
    assert all(p.holding is Holding.WHOLE and not p.separate_master for p in plain.layout.places)
    with pytest.raises(TypeError, match="state_layout"):
        optimizer_state(object())


def test_mistakes_are_named():
    model = _model(0)
    layout = _flat_layout(model, cuts=[4], lr=0.1)
    with pytest.raises(ValueError, match=r"shape \(4, 3\) that is not a parameter of the module"):
        OptimizerState(layout).full_state_dict({})
    with pytest.raises(ValueError, match="FLAT place takes pieces only"):
        ParamPlace(model[0].weight, (4, 3), Holding.FLAT, False, tensor=model[0].weight)
    with pytest.raises(ValueError, match="WHOLE place takes one tensor only"):
        ParamPlace(model[0].weight, (4, 3), Holding.WHOLE, False)
    with pytest.raises(ValueError, match="2 param groups but this one has 1"):
        install_optimizer_state(layout.optimizer, {}, [{}, {}])
