"""``export_deepspeed_stage0`` / ``shardwise checkpoint to-deepspeed``: a shardwise checkpoint
written as DeepSpeed's native ZeRO-0 layout reads back through shardwise's own DeepSpeed importer
to the very same tensors, and a run resumed from it trains on exactly.

(DeepSpeed itself resuming these files is checked by ``make test-interop``, stage 0.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import shardwise
from shardwise.checkpoint import keys, layout
from shardwise.checkpoint.deepspeed_export import export_deepspeed_stage0
from shardwise.checkpoint.deepspeed_import import DeepSpeedCheckpoint, load_file
from shardwise.checkpoint.universal_write import read_full_checkpoint
from shardwise.cli.main import main as cli_main


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(5, 8)
        self.fc2 = nn.Linear(8, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = self.head(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))
        return ((out.float() - y) ** 2).mean()


OPTIMIZERS = {
    "AdamW": {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.01}},
    "Muon": {
        "type": "Muon",
        "params": {"lr": 0.01, "muon_lr": 0.02, "adam_lr": 0.01, "ns_method": "standard"},
    },
}


def _engine(stage: int, bf16: bool, optimizer: str, seed: int):
    torch.manual_seed(seed)
    net = Net()
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "optimizer": OPTIMIZERS[optimizer],
    }
    if bf16:
        config["bf16"] = {"enabled": True}
    engine, *_ = shardwise.initialize(model=net, model_parameters=net.parameters(), config=config)
    return engine


def _train(engine, start: int, steps: int, dtype: torch.dtype) -> list[float]:
    losses = []
    for step in range(start, start + steps):
        gen = torch.Generator().manual_seed(70 + step)
        x, y = torch.randn(4, 5, generator=gen).to(dtype), torch.randn(4, 3, generator=gen)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach().float()))
    return losses


@pytest.mark.parametrize(
    ("stage", "bf16", "optimizer"), [(0, False, "AdamW"), (1, True, "AdamW"), (0, True, "Muon")]
)
def test_export_reads_back_to_identical_tensors_and_trains_on_exactly(tmp_path: Path, stage, bf16, optimizer):
    dtype = torch.bfloat16 if bf16 else torch.float32
    engine = _engine(stage, bf16, optimizer, seed=0)
    _train(engine, 0, 2, dtype)
    engine.save_checkpoint(tmp_path / "s", tag="t2")
    saved_full = read_full_checkpoint(tmp_path / "s" / "t2")
    want, module = saved_full["optimizer"], saved_full["module"]
    reference = _train(engine, 2, 2, dtype)

    out = export_deepspeed_stage0(tmp_path / "s", tmp_path / "ds")
    assert out == tmp_path / "ds" / "t2" and layout.read_latest(tmp_path / "ds") == "t2"
    assert layout.detect_kind(out) == "deepspeed"
    saved = load_file(out / "mp_rank_00_model_states.pt")  # plain values: weights-only, no stand-ins
    assert saved["global_steps"] == 2 and saved["param_shapes"] is None
    wrapper = "fp32_groups" if optimizer == "Muon" else "fp32_groups_flat"
    assert (wrapper in saved["optimizer"]) == bf16

    ckpt = DeepSpeedCheckpoint(out)
    assert ckpt.stage == 0
    for name, tensor in ckpt.module_state_dict().items():
        assert tensor.dtype == module[name].dtype and torch.equal(tensor, module[name]), name
    got = ckpt.optimizer_state([n for n, p in engine.module.named_parameters() if p.requires_grad])
    assert got is not None
    tensors = [k for k in want if k != keys.PARAM_GROUPS]
    assert len(tensors) >= 12 and set(tensors) <= set(got)
    for key in tensors:
        a, b = want[key], got[key]
        if torch.is_tensor(a) and a.dim() > 0:
            assert torch.equal(a.float(), b.float().reshape(a.shape)), key
        else:
            assert float(a) == float(b), key

    resumed = _engine(stage, bf16, optimizer, seed=1)
    resumed.load_checkpoint(tmp_path / "ds")
    assert resumed.global_steps == 2
    assert _train(resumed, 2, 2, dtype) == reference


def test_cli_to_deepspeed_writes_and_refuses_a_foreign_checkpoint(tmp_path: Path, capsys):
    engine = _engine(0, False, "AdamW", seed=0)
    _train(engine, 0, 1, torch.float32)
    engine.save_checkpoint(tmp_path / "s")
    assert cli_main(["checkpoint", "to-deepspeed", str(tmp_path / "s"), str(tmp_path / "ds")]) == 0
    assert "wrote" in capsys.readouterr().out
    assert layout.read_latest(tmp_path / "ds") == "global_step1"
    assert cli_main(["checkpoint", "to-deepspeed", str(tmp_path / "ds"), str(tmp_path / "again")]) == 1
    assert "to-deepspeed converts shardwise checkpoints" in capsys.readouterr().err
