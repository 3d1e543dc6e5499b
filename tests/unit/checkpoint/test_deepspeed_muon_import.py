"""DeepSpeed's Muon checkpoints (committed fixtures, tests/fixtures/make_deepspeed_muon_ckpt.py) read by
parameter name: after DeepSpeed's first step every state is a known multiple of the first gradient,
computed here with plain torch, whatever DeepSpeed's layout (per parameter at stage 0, whole
parameters per rank at ZeRO-1/2, flat partitions at ZeRO-3, the bf16 wrapper's flat group)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from shardwise.checkpoint import keys
from shardwise.checkpoint.deepspeed_import import DeepSpeedCheckpoint
from shardwise.checkpoint.universal_write import shardwise_to_universal

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
_spec = importlib.util.spec_from_file_location("make_muon", FIXTURES / "make_deepspeed_muon_ckpt.py")
assert _spec is not None and _spec.loader is not None
make_muon = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_muon)


def first_gradients(clip: bool = True) -> dict[str, torch.Tensor]:
    """The gradient DeepSpeed's first step used: the global batch's mean loss at the seeded weights,
    clipped to global norm 1.0 (DeepSpeed 0.19.8's default ``gradient_clipping``) when ``clip``."""
    torch.manual_seed(0)
    net = make_muon.Net()
    net(*make_muon.global_batch()).backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
    return {name: p.grad.detach().clone() for name, p in net.named_parameters()}


def assert_one_multiple(states: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]) -> float:
    """Every state is the same multiple of its parameter's gradient (within 1e-6); returns it.

    DeepSpeed clips at stage 0 before Muon's momentum and at ZeRO-1/2/3 after it (its clipping
    norm there includes the orthogonalised updates), so the factor depends on the stage; a
    fragment put at the wrong parameter or offset breaks the proportionality everywhere.
    """
    got = torch.cat([states[n].flatten() for n in states])
    want = torch.cat([grads[n].flatten() for n in states])
    factor = float(got @ want / (want @ want))
    for name, state in states.items():
        assert state.shape == grads[name].shape, name
        torch.testing.assert_close(state, factor * grads[name], rtol=0, atol=1e-6, msg=name)
    return factor


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_muon_momentum_and_adam_moments_by_name(stage: int, tmp_path: Path) -> None:
    ckpt = DeepSpeedCheckpoint(FIXTURES / "deepspeed_muon" / f"stage{stage}" / "global_step1")
    names = list(ckpt.module_state_dict())
    state = ckpt.optimizer_state(names)
    assert state is not None
    grads = first_gradients(clip=stage == 0)
    muon = [n for n in names if n.endswith("weight")]
    momentum = assert_one_multiple({n: state[f"optim/{n}/momentum_buffer"] for n in muon}, grads)
    # Muon's momentum after one step from zero is (1 - 0.9) * g, exactly
    assert momentum == pytest.approx(0.1, abs=1e-6)
    adam = assert_one_multiple({n: state[f"optim/{n}/exp_avg"] for n in names if n not in muon}, grads)
    assert 0 < adam <= 0.1 + 1e-6
    groups = {g["name"]: g[keys.PARAM_NAMES] for g in state[keys.PARAM_GROUPS]}
    # DeepSpeed's Muon sorts its matrices by shape, largest first
    assert groups == {
        "muon-params": ["fc2.weight", "fc1.weight", "head.weight"],
        "adam-params": ["fc1.bias", "fc2.bias", "head.bias"],
    }
    out = shardwise_to_universal(FIXTURES / "deepspeed_muon" / f"stage{stage}", tmp_path / "uni")
    saved = torch.load(out / "zero" / "fc2.weight" / "momentum_buffer.pt", weights_only=True)
    torch.testing.assert_close(saved["param"], state["optim/fc2.weight/momentum_buffer"], rtol=0, atol=0)


def test_stage0_bf16_wrapper_flat_group() -> None:
    ckpt = DeepSpeedCheckpoint(FIXTURES / "deepspeed_muon" / "stage0_bf16" / "global_step1")
    module = ckpt.module_state_dict()
    state = ckpt.optimizer_state(list(module))
    assert state is not None
    grads = first_gradients()
    for name, tensor in module.items():
        master = state[f"master/{name}"]
        assert master.dtype == torch.float32 and master.shape == tensor.shape
        # the bf16 weight is the fp32 master rounded
        torch.testing.assert_close(master.to(torch.bfloat16), tensor, rtol=0, atol=0)
        # bf16 forward/backward: the first moment is 0.1 * g up to bf16 rounding of the gradient
        torch.testing.assert_close(state[f"optim/{name}/exp_avg"], 0.1 * grads[name], rtol=0.05, atol=2e-3)
