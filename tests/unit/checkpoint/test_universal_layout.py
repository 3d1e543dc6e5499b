"""DeepSpeed's universal checkpoint layout without DeepSpeed: DeepSpeed's own ``ds_to_universal``
output (committed fixtures) reads back to the recorded values; shardwise -> universal -> shardwise
is bit-equal; a universal directory written by hand (SGD momentum: not Adam's state) loads with
``load_universal`` and trains on exactly; the universal files need no foreign classes to unpickle.
Both-ways resumption against real DeepSpeed is ``make test-interop`` (benchmarks/universal_interop.py)."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import pytest
import torch
from torch import nn

import shardwise
from shardwise.checkpoint import dcp_io, engine_io, keys, layout
from shardwise.checkpoint.export import checkpoint_info, load_full_state_dict
from shardwise.checkpoint.from_universal import universal_to_shardwise
from shardwise.checkpoint.training_state import param_names
from shardwise.checkpoint.universal_read import UniversalCheckpoint, read_universal_checkpoint
from shardwise.checkpoint.universal_write import shardwise_to_universal
from shardwise.cli.main import main as cli_main

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "deepspeed_universal"


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(5, 7)
        self.frozen = nn.Linear(7, 7)
        self.head = nn.Linear(7, 3)
        self.register_buffer("shift", torch.linspace(-1, 1, 3))
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        out = self.head(h + torch.tanh(self.frozen(h))) + self.shift
        return ((out.float() - y) ** 2).mean()


def _batch(step: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(50 + step)
    return torch.randn(4, 5, generator=gen).to(dtype), torch.randn(4, 3, generator=gen)


def _engine(stage: int, bf16: bool, seed: int, universal: bool = False, optimizer=None):
    torch.manual_seed(seed)
    net = Net()
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 0.0,  # the reference SGD step below does not clip
    }
    if optimizer is None:
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.01}}
    else:
        config["zero_allow_untested_optimizer"] = True  # SGD is element-wise: exact on shards
    if bf16:
        config["bf16"] = {"enabled": True}
    if universal:
        config["checkpoint"] = {"load_universal": True}
    params = [p for p in net.parameters() if p.requires_grad]
    client = optimizer(params) if optimizer is not None else None
    engine, *_ = shardwise.initialize(model=net, model_parameters=params, optimizer=client, config=config)
    return engine


def _train(engine, start: int, steps: int, dtype: torch.dtype = torch.float32) -> list[float]:
    losses = []
    for step in range(start, start + steps):
        loss = engine(*_batch(step, dtype))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach().float()))
    return losses


def _full_state(engine) -> dict:
    return engine_io.optimizer_state(engine.optimizer).full_state_dict(param_names(engine.module))


# ---------------------------------------------------------------------------- DeepSpeed's own output
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeeds_universal_output_reads_back_to_its_recorded_values(stage):
    root = FIXTURES / f"stage{stage}"
    expected = torch.load(root / "expected.pt")
    ckpt = read_universal_checkpoint(root)
    assert ckpt.stage == stage and ckpt.world_size == 2
    state = ckpt.optimizer_state()
    for name, value in expected["params"].items():
        assert torch.equal(state[f"master/{name}"], value), name
        assert torch.equal(state[f"optim/{name}/exp_avg"], expected["exp_avg"][name]), name
        assert torch.equal(state[f"optim/{name}/exp_avg_sq"], expected["exp_avg_sq"][name]), name
        assert state[f"optim/{name}/step"] == expected["global_steps"], name
    module = ckpt.module_state_dict()
    for name, value in {**expected["params"], **expected["frozen"], **expected["buffers"]}.items():
        assert torch.equal(module[name], value), name  # frozen ZeRO-3 weights from the copied fragments
    groups = state[keys.PARAM_GROUPS]
    assert [n for g in groups for n in g[keys.PARAM_NAMES]] == list(expected["params"])
    assert groups[0]["lr"] == pytest.approx(1e-2)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_native_deepspeed_checkpoints_convert_too(tmp_path, stage):
    native = FIXTURES.parent / "deepspeed_ckpt" / f"stage{stage}"
    expected = torch.load(native / "expected.pt")
    out = shardwise_to_universal(native, tmp_path / "u")
    for path in out.rglob("*.pt"):
        torch.load(path, weights_only=True)
    state = UniversalCheckpoint(out).optimizer_state()
    for name, value in expected["params"].items():
        assert torch.equal(state[f"master/{name}"], value), name
        assert torch.equal(state[f"optim/{name}/exp_avg_sq"], expected["exp_avg_sq"][name]), name
    module = UniversalCheckpoint(out).module_state_dict()
    assert all(torch.equal(module[n], v) for n, v in {**expected["frozen"], **expected["buffers"]}.items())


def test_a_stage_0_deepspeed_checkpoint_with_frozen_parameters_is_refused_not_guessed(tmp_path):
    # DeepSpeed's stage-0 file does not say which module parameters its optimizer holds; this
    # model has 8 parameters and 6 optimizer entries, so the mapping is unknown (the interop run
    # converts a stage-0 checkpoint without frozen parameters)
    with pytest.raises(ValueError, match="optimizer state is not readable"):
        shardwise_to_universal(FIXTURES.parent / "deepspeed_ckpt" / "stage0", tmp_path / "u")
    assert not (tmp_path / "u" / "latest_universal").exists()


def test_info_verify_and_export_read_a_universal_checkpoint(tmp_path, capsys):
    root = FIXTURES / "stage2"
    info = checkpoint_info(root)
    assert info["latest"] == "global_step2"
    (tag,) = info["tags"]
    assert tag["kind"] == "universal" and tag["integrity"] == "ok" and tag["zero_stage"] == 2
    assert tag["optimizer_state_keys"] == ["exp_avg", "exp_avg_sq", "step"]
    weights = load_full_state_dict(root / "global_step2")
    expected = torch.load(root / "expected.pt")
    assert all(torch.equal(weights[n], v) for n, v in expected["params"].items())
    assert cli_main(["checkpoint", "verify", str(root)]) == 0
    assert "global_step2: ok" in capsys.readouterr().out


# ---------------------------------------------------------------------------- round trip
@pytest.mark.parametrize(("stage", "bf16"), [(0, False), (2, True)])
def test_shardwise_to_universal_to_shardwise_is_bit_equal_and_trains_on_exactly(tmp_path, stage, bf16):
    dtype = torch.bfloat16 if bf16 else torch.float32
    engine = _engine(stage, bf16, seed=0)
    _train(engine, 0, 3, dtype)
    engine.save_checkpoint(tmp_path / "a", tag="t3", client_state={"epoch": 7})
    reference = _train(engine, 3, 2, dtype)

    out = shardwise_to_universal(tmp_path / "a", tmp_path / "u")
    assert out == tmp_path / "u" / "t3" and layout.read_latest(tmp_path / "u", layout.LATEST_UNIVERSAL) == "t3"
    for path in out.rglob("*.pt"):  # plain values only: loads without DeepSpeed's classes or stand-ins
        torch.load(path, weights_only=True)
    back = universal_to_shardwise(tmp_path / "u", tmp_path / "b")

    original = dcp_io.StreamingReader(tmp_path / "a" / "t3")
    copy = dcp_io.StreamingReader(back)
    tensors = [k for k in original.entries if k.startswith((keys.MODEL, keys.MASTER, keys.OPTIM))]
    assert len(tensors) > 10 and set(tensors) <= set(copy.entries)
    for key in tensors:
        a, b = original.read(key), copy.read(key)
        if key == keys.PARAM_GROUPS:
            assert a == b
        elif torch.is_tensor(a) and a.dim() > 0:
            assert a.dtype == b.dtype and torch.equal(a, b), key
        else:
            assert float(a) == float(b), key
    common = copy.read(keys.COMMON)
    assert common["counters"]["global_steps"] == 3 and common["client_state"]["epoch"] == 7

    for source, universal in ((tmp_path / "b", False), (tmp_path / "u", True)):
        resumed = _engine(stage, bf16, seed=1, universal=universal)
        resumed.load_checkpoint(source)
        assert resumed.global_steps == 3
        assert _train(resumed, 3, 2, dtype) == reference, source


# ---------------------------------------------------------------------------- a hand-made directory
def _save(value: object, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(value, path)


def test_a_hand_written_universal_directory_with_sgd_momentum_loads_and_steps_exactly(tmp_path):
    torch.manual_seed(3)
    shapes = {"fc1.weight": (7, 5), "fc1.bias": (7,), "head.weight": (3, 7), "head.bias": (3,)}
    fp32 = {n: torch.randn(s) for n, s in shapes.items()}
    momentum = {n: torch.randn(s) for n, s in shapes.items()}
    module = {**fp32, "frozen.weight": torch.randn(7, 7), "frozen.bias": torch.randn(7), "shift": torch.zeros(3)}
    tag = tmp_path / "uni" / "step9"
    _save(
        {
            "module": collections.OrderedDict((n, module[n]) for n in Net().state_dict()),
            "buffer_names": ["shift"],
            "param_shapes": [collections.OrderedDict((n, torch.Size(s)) for n, s in shapes.items())],
            "global_steps": 9,
            "skipped_steps": 0,
            "dp_world_size": 4,
        },
        tag / "mp_rank_00_model_states.pt",
    )
    group = {"lr": 0.1, "momentum": 0.9, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False, "params": [0]}
    _save({"param_groups": [group], "ds_version": "0.19.8", "zero_stage": 2}, tag / "zero" / "optimizer_state.pt")
    for name in shapes:  # any optimizer's per-parameter state is carried: SGD's momentum_buffer here
        _save({"param": fp32[name], "cat_dim": 0}, tag / "zero" / name / "fp32.pt")
        _save({"param": momentum[name], "cat_dim": 0}, tag / "zero" / name / "momentum_buffer.pt")
    (tmp_path / "uni" / "latest_universal").write_text("step9")

    def sgd(params):
        return torch.optim.SGD(params, lr=0.5, momentum=0.1)

    engine = _engine(2, False, seed=0, universal=True, optimizer=sgd)
    engine.load_checkpoint(tmp_path / "uni")
    assert engine.global_steps == 9
    state = _full_state(engine)
    for name in shapes:
        assert torch.equal(state[f"master/{name}"], fp32[name])
        assert torch.equal(state[f"optim/{name}/momentum_buffer"], momentum[name])
    assert state[keys.PARAM_GROUPS][0]["lr"] == 0.1 and state[keys.PARAM_GROUPS][0]["momentum"] == 0.9
    assert torch.equal(engine.module.state_dict()["frozen.weight"], module["frozen.weight"])

    reference = Net()
    reference.load_state_dict({n: module[n] for n in reference.state_dict()})
    params = [p for p in reference.parameters() if p.requires_grad]
    torch_sgd = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    named = dict(reference.named_parameters())
    for name in shapes:
        torch_sgd.state[named[name]]["momentum_buffer"] = momentum[name].clone()
    x, y = _batch(0)
    reference(x, y).backward()
    torch_sgd.step()
    _train(engine, 0, 1)
    after = engine.module.state_dict()
    for name in shapes:
        assert torch.equal(after[name], named[name].detach()), name


# ---------------------------------------------------------------------------- errors
def test_load_universal_needs_a_universal_checkpoint(tmp_path):
    engine = _engine(0, False, seed=0)
    _train(engine, 0, 1)
    engine.save_checkpoint(tmp_path / "native", tag="t1")
    reader = _engine(0, False, seed=1, universal=True)
    with pytest.raises(ValueError, match="latest_universal does not exist"):
        reader.load_checkpoint(tmp_path / "native")
    with pytest.raises(ValueError, match="is a shardwise checkpoint, not a universal one"):
        reader.load_checkpoint(tmp_path / "native", tag="t1")
    with pytest.raises(ValueError, match="is a universal checkpoint; to-universal converts"):
        shardwise_to_universal(FIXTURES / "stage2", tmp_path / "x")
    with pytest.raises(FileNotFoundError, match=r"optimizer_state\.pt is missing"):
        UniversalCheckpoint(tmp_path / "native" / "t1")


def test_cli_converts_both_ways(tmp_path, capsys):
    engine = _engine(1, False, seed=0)
    _train(engine, 0, 2)
    engine.save_checkpoint(tmp_path / "s")
    assert cli_main(["checkpoint", "to-universal", str(tmp_path / "s"), str(tmp_path / "u")]) == 0
    assert "wrote" in capsys.readouterr().out
    assert cli_main(["checkpoint", "from-universal", str(tmp_path / "u"), str(tmp_path / "b")]) == 0
    assert layout.read_latest(tmp_path / "b") == "global_step2"
    assert cli_main(["checkpoint", "from-universal", str(tmp_path / "s"), str(tmp_path / "c")]) == 1
    assert "error:" in capsys.readouterr().err
    info = json.loads(json.dumps(checkpoint_info(tmp_path / "b"), default=str))
    assert info["tags"][0]["integrity"] == "ok" and info["tags"][0]["global_steps"] == 2


def test_the_clients_universal_checkpoint_info_is_kept_with_this_layouts_version() -> None:
    # Megatron-DeepSpeed stores its description (vocabulary sizes, parameter patterns) in the client state
    from shardwise.checkpoint.universal_names import UNIVERSAL_INFO, UNIVERSAL_VERSION, UNIVERSAL_VERSION_KEY
    from shardwise.checkpoint.universal_write import _model_states

    info = {UNIVERSAL_VERSION_KEY: 0.4, "original_vocab_size": 50257, "padded_vocab_size": 50304,
            "vocabulary_parameter_patterns": ["embed.weight"]}
    states = _model_states({"w": torch.ones(2)}, [], {}, {"global_steps": 1}, {"train_batch_size": 2}, None,
                           {UNIVERSAL_INFO: info, "iteration": 5}, 1, [])
    assert states[UNIVERSAL_INFO] == {**info, UNIVERSAL_VERSION_KEY: UNIVERSAL_VERSION}
    assert states["iteration"] == 5
    plain = _model_states({"w": torch.ones(2)}, [], {}, {}, {}, None, None, 1, [])
    assert plain[UNIVERSAL_INFO] == {UNIVERSAL_VERSION_KEY: UNIVERSAL_VERSION}
