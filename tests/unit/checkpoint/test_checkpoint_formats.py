"""Checkpoint pieces without a process group: box maths, DCP resharding, writers, layout,
RNG, DeepSpeed import from the committed 0.19.8 fixtures, export and the CLI."""

from __future__ import annotations

import itertools
import json
import math
import random
import warnings
from pathlib import Path

import pytest
import torch

from shardwise.checkpoint import dcp_io, layout, rng
from shardwise.checkpoint.boxes import flat_range_to_boxes
from shardwise.checkpoint.deepspeed_import import DeepSpeedCheckpoint
from shardwise.checkpoint.export import checkpoint_info, export_checkpoint, load_full_state_dict
from shardwise.checkpoint.param_state import ParamOptimizerState
from shardwise.checkpoint.writers import read_safetensors, write_state_dict
from shardwise.cli.checkpoint_cmd import add_parser

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "deepspeed_ckpt"


# ---------------------------------------------------------------------------- boxes
@pytest.mark.parametrize("shape", [(7,), (3, 4), (2, 3, 4), (4, 1, 5), (1, 1, 3), ()])
def test_every_flat_range_is_covered_exactly_by_contiguous_boxes(shape):
    numel = math.prod(shape)
    strides = torch.empty(shape).stride() if shape else ()
    for start, stop in itertools.combinations(range(numel + 1), 2):
        boxes = flat_range_to_boxes(shape, start, stop)
        assert len(boxes) <= max(1, 2 * len(shape) - 1)
        covered = []
        position = start
        for box in boxes:
            assert box.flat_start == position, (shape, start, stop)  # in flat order, no gaps
            flat = [
                sum(i * s for i, s in zip(idx, strides))
                for idx in itertools.product(*(range(o, o + n) for o, n in zip(box.offsets, box.sizes)))
            ]
            assert flat == list(range(box.flat_start, box.flat_start + box.numel))  # contiguous
            covered.extend(flat)
            position += box.numel
        assert covered == list(range(start, stop))


def test_boxes_refuse_ranges_outside_the_tensor():
    with pytest.raises(ValueError, match="outside"):
        flat_range_to_boxes((2, 3), 4, 7)
    assert flat_range_to_boxes((2, 3), 2, 2) == []


# ---------------------------------------------------------------------------- DCP with flat shards
def _dcp_quiet():
    return warnings.catch_warnings(action="ignore")


def test_flat_shards_save_in_one_layout_and_load_in_another(tmp_path):
    full = torch.randn(5, 6, 3)
    flat = full.reshape(-1).clone()
    cuts = [0, 7, 40, 61, 90]
    pieces = [(a, b, flat[a:b]) for a, b in itertools.pairwise(cuts)]
    state = {
        "w": dcp_io.FlatShards(full.shape, full.dtype, pieces),
        "groups": [{"lr": 0.1}],
        "s": torch.tensor(2.0),
    }
    with _dcp_quiet():
        dcp_io.save(state, tmp_path, no_dist=True)
    target = torch.zeros(90)
    other = [(0, 33, target[0:33]), (33, 90, target[33:90])]
    loaded = {"w": dcp_io.FlatShards(full.shape, full.dtype, other), "groups": None}
    with _dcp_quiet():
        dcp_io.load(loaded, tmp_path, no_dist=True)
    assert torch.equal(target, flat)
    assert loaded["groups"] == [{"lr": 0.1}]
    reader = dcp_io.StreamingReader(tmp_path)
    assert torch.equal(reader.read("w"), full)  # stored at its real shape
    assert reader.entries["w"] == dcp_io.SavedEntry((5, 6, 3), torch.float32)
    assert not reader.entries["groups"].is_tensor
    with pytest.raises(KeyError, match="nope"):
        reader.read("nope")


def test_flat_shards_fill_from_full_and_snapshot_is_a_copy():
    full = torch.arange(12.0).view(3, 4)
    buffer = torch.zeros(5)
    shards = dcp_io.FlatShards((3, 4), torch.float32, [(3, 8, buffer)])
    shards.fill_from(full)
    assert buffer.tolist() == [3.0, 4.0, 5.0, 6.0, 7.0]
    copy = shards.snapshot()
    buffer.zero_()
    assert torch.cat([t.reshape(-1) for t in copy.local_tensors()]).tolist() == [3.0, 4.0, 5.0, 6.0, 7.0]
    with pytest.raises(ValueError, match="shape"):
        shards.fill_from(torch.zeros(4, 3))


# ---------------------------------------------------------------------------- writers
def _sample_state():
    return {
        "w": torch.randn(3, 4),
        "ids": torch.arange(5),
        "half": torch.randn(2, 2, dtype=torch.bfloat16),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 3),
    }


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_streamed_files_round_trip_with_torch_and_safetensors_readers(tmp_path, fmt):
    state = _sample_state()
    specs = {k: (tuple(v.shape), v.dtype) for k, v in state.items()}
    out = write_state_dict(tmp_path / f"m.{fmt}", specs, iter(state.items()), fmt=fmt)
    loaded = torch.load(out, weights_only=True) if fmt == "pt" else read_safetensors(out)
    assert list(loaded) == list(state)
    for key, value in state.items():
        assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value), key
    if fmt == "safetensors":
        header_len = int.from_bytes(out.read_bytes()[:8], "little")
        header = json.loads(out.read_bytes()[8 : 8 + header_len])
        assert header["w"] == {"dtype": "F32", "shape": [3, 4], "data_offsets": [0, 48]}
        assert (8 + header_len) % 8 == 0


def test_writer_refuses_empty_or_inconsistent_input_and_leaves_no_file(tmp_path):
    with pytest.raises(ValueError, match="empty"):
        write_state_dict(tmp_path / "a.safetensors", {}, iter([]))
    specs = {"a": ((2,), torch.float32), "b": ((2,), torch.float32)}
    with pytest.raises(ValueError, match="announced"):
        write_state_dict(
            tmp_path / "b.pt", specs, iter([("a", torch.zeros(3)), ("b", torch.zeros(2))]), fmt="pt"
        )
    with pytest.raises(ValueError, match="1 of 2"):
        write_state_dict(tmp_path / "c.safetensors", specs, iter([("a", torch.zeros(2))]))
    with pytest.raises(ValueError, match="out of order"):
        write_state_dict(tmp_path / "d.safetensors", specs, iter([("b", torch.zeros(2))]))
    assert sorted(p.name for p in tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------- layout
def test_publish_latest_and_recovery_from_an_interrupted_resave(tmp_path):
    assert layout.check_tag(12) == "12"
    for bad in ("", ".hidden", "a/b", "latest"):
        with pytest.raises(ValueError, match="tag"):
            layout.check_tag(bad)
    staging = layout.prepare_staging(tmp_path, "t1")
    (staging / ".metadata").write_bytes(b"x")
    layout.publish(tmp_path, "t1")
    layout.write_latest(tmp_path, "t1")
    assert (tmp_path / "latest").read_bytes() == b"t1"  # DeepSpeed's format: no newline
    assert layout.list_tags(tmp_path) == ["t1"] and layout.resolve(tmp_path) == tmp_path / "t1"
    # re-save the same tag: the old directory is replaced
    staging = layout.prepare_staging(tmp_path, "t1")
    (staging / ".metadata").write_bytes(b"new")
    layout.publish(tmp_path, "t1")
    assert (tmp_path / "t1" / ".metadata").read_bytes() == b"new"
    # a crash between the two renames of a re-save: the tag is found under .t1.old
    (tmp_path / "t1").rename(tmp_path / ".t1.old")
    assert layout.tag_path(tmp_path, "t1") == tmp_path / ".t1.old"
    # a stale partial directory is not a tag and is cleaned by the next save of that tag
    stale = layout.prepare_staging(tmp_path, "t2")
    (stale / "junk").write_text("x")
    assert layout.list_tags(tmp_path) == []
    assert list(layout.prepare_staging(tmp_path, "t2").iterdir()) == []
    with pytest.raises(FileNotFoundError, match="no checkpoint tag 'zz'"):
        layout.tag_path(tmp_path, "zz")


def test_rng_capture_and_restore_cover_python_numpy_and_torch():
    import numpy as np

    state = rng.capture()
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    random.random(), np.random.rand(), torch.rand(3)
    rng.restore(state)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_param_optimizer_state_round_trips_through_full_state():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    names = {id(p): n for n, p in model.named_parameters()}
    full = ParamOptimizerState(opt).full_state_dict(names)
    torch.manual_seed(1)
    other = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    other_opt = torch.optim.AdamW(other.parameters(), lr=0.5)
    ParamOptimizerState(other_opt).load_full_state_dict(full, {id(p): n for n, p in other.named_parameters()})
    assert other_opt.param_groups[0]["lr"] == 0.1
    for (_, p), (_, q) in zip(model.named_parameters(), other.named_parameters()):
        assert torch.equal(opt.state[p]["exp_avg"], other_opt.state[q]["exp_avg"])
        assert torch.equal(opt.state[p]["step"], other_opt.state[q]["step"])


def test_param_optimizer_state_with_separate_fp32_masters_saves_and_restores_them(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).to(torch.bfloat16)
    masters = [p.detach().float().clone() for p in model.parameters()]
    opt = torch.optim.SGD(masters, lr=0.1)
    state = ParamOptimizerState(opt, {id(m): p for m, p in zip(masters, model.parameters())})
    names = {id(p): n for n, p in model.named_parameters()}
    masters[0].add_(1e-3)  # a master value its bf16 parameter cannot represent exactly
    items = state.sharded_state_dict(names)
    assert torch.equal(items["master/weight"], masters[0])
    model_items = {f"model/{k}": v for k, v in model.state_dict().items()}
    with _dcp_quiet():
        dcp_io.save({**items, **model_items}, tmp_path, no_dist=True)
    fresh_masters = [torch.zeros_like(m) for m in masters]
    fresh_of = {id(m): p for m, p in zip(fresh_masters, model.parameters())}
    fresh = ParamOptimizerState(torch.optim.SGD(fresh_masters, lr=0.5), fresh_of)
    targets, finish = fresh.sharded_load(names, dcp_io.StreamingReader(tmp_path).entries, with_state=True)
    with _dcp_quiet():
        dcp_io.load(targets, tmp_path, no_dist=True)
    finish(targets)
    assert torch.equal(fresh_masters[0], masters[0]) and fresh.optimizer.param_groups[0]["lr"] == 0.1
    assert torch.equal(model.weight, masters[0].to(torch.bfloat16))  # parameters follow their masters


# ---------------------------------------------------------------------------- DeepSpeed 0.19.8 fixtures
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_deepspeed_checkpoints_are_reconstructed_exactly(stage):
    base = FIXTURES / f"stage{stage}"
    expected = torch.load(base / "expected.pt")
    ckpt = DeepSpeedCheckpoint(base / "global_step2")
    assert (ckpt.stage, ckpt.world_size) == (stage, 2)
    full = ckpt.optimizer_state(list(expected["params"]))
    for name, value in expected["params"].items():
        assert torch.equal(full[f"master/{name}"], value), name
        assert torch.equal(full[f"optim/{name}/exp_avg"], expected["exp_avg"][name]), name
        assert torch.equal(full[f"optim/{name}/exp_avg_sq"], expected["exp_avg_sq"][name]), name
        assert float(full[f"optim/{name}/step"]) == 2.0
    assert full["optim/param_groups"][0]["lr"] == 0.01
    module = ckpt.module_state_dict()
    for name, value in {**expected["frozen"], **expected["buffers"]}.items():
        assert torch.equal(module[name], value), name
    assert "inp.weight" in module and "frozen.weight" in module


@pytest.mark.parametrize("stage", [2, 3])
def test_export_streams_a_deepspeed_checkpoint_to_safetensors(tmp_path, stage):
    expected = torch.load(FIXTURES / f"stage{stage}" / "expected.pt")
    out = export_checkpoint(FIXTURES / f"stage{stage}", tmp_path)
    assert out == tmp_path / "model.safetensors"
    exported = read_safetensors(out)
    for name, value in {**expected["params"], **expected["frozen"], **expected["buffers"]}.items():
        assert torch.equal(exported[name], value), name
    info = checkpoint_info(FIXTURES / f"stage{stage}")
    assert info["latest"] == "global_step2"
    assert info["tags"][0]["zero_stage"] == stage and info["tags"][0]["world_size"] == 2


def test_cli_info_and_export(tmp_path, capsys):
    import argparse

    parser = argparse.ArgumentParser(prog="shardwise")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["checkpoint", "info", str(FIXTURES / "stage1")])
    assert args.func(args) == 0
    assert "global_step2: deepspeed, ZeRO 1, world size 2, step 2" in capsys.readouterr().out
    out = tmp_path / "m.bin"
    args = parser.parse_args(["checkpoint", "export", str(FIXTURES / "stage1"), str(out), "--dtype", "bf16"])
    assert args.func(args) == 0
    loaded = torch.load(out, weights_only=True)
    assert loaded["inp.weight"].dtype == torch.bfloat16 and loaded["offset"].dtype == torch.bfloat16
    args = parser.parse_args(["checkpoint", "export", str(tmp_path / "nothing"), str(out)])
    assert args.func(args) == 1
    assert "no checkpoint" in capsys.readouterr().err


def test_load_full_state_dict_of_a_deepspeed_stage0_checkpoint():
    expected = torch.load(FIXTURES / "stage0" / "expected.pt")
    state = load_full_state_dict(FIXTURES / "stage0")
    assert all(torch.equal(state[n], v) for n, v in expected["params"].items())
