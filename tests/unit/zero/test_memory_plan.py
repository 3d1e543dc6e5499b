"""The memory plan, the stage-3 knob mapping and wrap policy, and the offload store, without a process group.

The plan's agreement with what stage 3 really allocates (within 10%) is measured on two
ranks in tests/distributed/test_stage3.py; here the arithmetic is pinned by hand-computed
cases, so a change in the formulas fails loudly.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from shardwise.cli import config_cmd, plan_cmd
from shardwise.config import load_config
from shardwise.config.sections.zero import ZeroConfig
from shardwise.testing.models import GPTConfig, TinyGPT
from shardwise.zero.memory_plan import estimate_model_states_memory, plan_from_config
from shardwise.zero.nvme import AioSettings, SwapFile
from shardwise.zero.offload import (
    OffloadedOptimizer,
    OffloadSpec,
    OffloadStore,
    offloaded_prefix,
    split_sub_groups,
)
from shardwise.zero.stage3_settings import KEY_NOTES, engine_notes, inert_keys, key_note, settings_from_zero
from shardwise.zero.wrap_policy import choose_units, describe_modules, prefetch_plan, reshard_plan

N = 1_000_000


# --------------------------------------------------------------------------- the plan, by hand
@pytest.mark.parametrize(
    ("stage", "precision", "expected"),
    [
        # (params, grads, optimizer) per rank, W = 2, AdamW (8 B of state per element)
        (0, "fp32", (4 * N, 4 * N, 8 * N)),
        (0, "bf16", (2 * N, 4 * N, 8 * N + 4 * N)),  # whole fp32 masters
        (1, "fp32", (4 * N, 4 * N, 4 * N)),
        (1, "bf16", (2 * N, 4 * N, 4 * N + 2 * N)),
        (2, "fp32", (4 * N, 2 * N, 4 * N)),
        (2, "fp16", (2 * N, 2 * N, 4 * N + 2 * N)),
        (3, "fp32", (2 * N, 2 * N, 4 * N)),
        (3, "bf16", (2 * N, 2 * N, 4 * N)),  # stage 3: the fp32 shards are the masters
    ],
)
def test_plan_by_stage_and_precision(stage, precision, expected):
    plan = estimate_model_states_memory(N, stage, 2, precision=precision)
    assert (plan.params, plan.grads, plan.optimizer) == expected
    assert plan.offloaded_host == plan.offloaded_nvme == 0


def test_stage3_fp32_is_eight_bytes_per_param_on_two_ranks():
    plan = estimate_model_states_memory(N, 3, 2)
    assert plan.bytes_per_param() == 8.0  # the target is <= 8.5 (DeepSpeed measured 10)


def test_optimizer_state_size_follows_the_optimizer():
    assert estimate_model_states_memory(N, 2, 2, optimizer="Lion").optimizer == 2 * N
    assert estimate_model_states_memory(N, 2, 2, optimizer="SGD").optimizer == 2 * N
    odd = estimate_model_states_memory(N, 2, 2, optimizer="MyOpt")
    assert odd.optimizer == 4 * N and "MyOpt" in odd.notes[0]


def test_offload_moves_optimizer_state_off_the_device():
    cpu = estimate_model_states_memory(N, 2, 2, offload_optimizer="cpu")
    assert cpu.optimizer == 0
    assert cpu.offloaded_host == 4 * N + 2 * N + 2 * N  # state + staging masters + staging grads
    nvme = estimate_model_states_memory(N, 2, 2, offload_optimizer="nvme")
    assert (nvme.optimizer, nvme.offloaded_host, nvme.offloaded_nvme) == (0, 0, 4 * N)
    three = estimate_model_states_memory(N, 3, 2, offload_optimizer="cpu", offload_ratio=0.5)
    assert three.optimizer == 2 * N and three.offloaded_host == 2 * N + N + N
    params_cpu = estimate_model_states_memory(N, 3, 2, offload_param="cpu", offload_optimizer="cpu")
    assert params_cpu.device_total == 0 and params_cpu.offloaded_host == 8 * N
    params_nvme = estimate_model_states_memory(N, 3, 2, offload_param="nvme", offload_optimizer="nvme")
    assert params_nvme.device_total == 0
    assert params_nvme.offloaded_host == 2 * N  # grads; the shards stream a sub-group at a time
    assert params_nvme.offloaded_nvme == 2 * N + 4 * N  # shard file + optimizer state file
    params_nvme_state_cpu = estimate_model_states_memory(N, 3, 2, offload_param="nvme", offload_optimizer="cpu")
    assert params_nvme_state_cpu.offloaded_host == 2 * N + 2 * N + 4 * N  # the step restores every shard


def test_plan_rejects_bad_input():
    with pytest.raises(ValueError, match="stage"):
        estimate_model_states_memory(N, 4, 2)
    with pytest.raises(ValueError, match="offload_optimizer"):
        estimate_model_states_memory(N, 2, 2, offload_optimizer="disk")
    with pytest.raises(ValueError, match="stage 1, 2 or 3"):
        estimate_model_states_memory(N, 0, 2, offload_optimizer="cpu")


def test_a_model_gives_tied_frozen_padded_and_persistent_sizes():
    model = TinyGPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32, qkv_bias=False))
    for p in model.blocks.parameters():
        p.requires_grad_(False)
    plan = estimate_model_states_memory(model, 3, 3, precision="bf16", persistence_threshold=100)
    unique = {id(p): p for p in model.parameters()}.values()
    trainable = sum(p.numel() for p in unique if p.requires_grad)
    frozen = sum(p.numel() for p in unique if not p.requires_grad)
    assert (plan.trainable, plan.frozen) == (trainable, frozen)  # the tied head counted once
    sharded = [p for p in unique if p.numel() >= 100]
    persistent = [p for p in unique if p.numel() < 100]

    def local(p):  # rows per rank: ceil(rows / 3)
        return -(-p.shape[0] // 3) * (p.numel() // p.shape[0])

    params = sum(4 * local(p) if p.requires_grad else 2 * local(p) for p in sharded)
    params += sum(2 * p.numel() for p in persistent)
    assert plan.params == params
    assert plan.grads == sum(4 * local(p) for p in sharded if p.requires_grad) + sum(
        4 * p.numel() for p in persistent if p.requires_grad
    )


def test_plan_from_config_reads_every_setting():
    cfg = load_config(
        {
            "train_batch_size": 8,
            "bf16": {"enabled": True},
            "optimizer": {"type": "Lion", "params": {"lr": 1e-4}},
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.5}},
        },
        world_size=4,
    ).config
    plan = plan_from_config(cfg, 4 * N, world_size=4)
    assert plan.stage == 3 and plan.world_size == 4
    shard = 4 * N // 4
    assert plan.optimizer == 4 * shard // 2  # Lion: 4 B per element, half of it offloaded
    assert plan.offloaded_host == (4 + 4 + 4) * shard // 2  # state + staging masters and grads


# --------------------------------------------------------------------------- the CLI
def _cli(argv):
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    config_cmd.add_parser(sub)
    plan_cmd.add_parser(sub)  # the registration line main.py needs
    args = parser.parse_args(argv)
    return args.func(args)


def test_config_plan_prints_bytes_per_rank(tmp_path, capsys):
    path = tmp_path / "ds.json"
    path.write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": 1,
                "zero_optimization": {"stage": 3, "overlap_comm": True, "zero_quantized_weights": False},
            }
        )
    )
    assert _cli(["config", "plan", str(path), "--params", "7B", "--world-size", "8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["bytes_per_rank"]["params"] == 4 * 7 * 10**9 // 8
    assert data["bytes_per_rank"]["optimizer"] == 8 * 7 * 10**9 // 8
    assert "no effect" in data["engine_notes"]["zero_optimization.overlap_comm"]
    assert "qwZ" in data["engine_notes"]["zero_optimization.zero_quantized_weights"]
    assert _cli(["config", "plan", str(path), "--params", "125M", "--world-size", "2"]) == 0
    text = capsys.readouterr().out
    assert "bytes per parameter" in text and "8.00" in text and "FSDP2" in text


def test_config_plan_reports_config_errors(tmp_path, capsys):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"train_batch_size": 4, "zero_optimization": {"stage": 7}}))
    assert _cli(["config", "plan", str(path), "--params", "1000"]) == 1
    assert "FAIL" in capsys.readouterr().err
    with pytest.raises(argparse.ArgumentTypeError):
        plan_cmd.parse_count("seven")


# --------------------------------------------------------------------------- knob mapping
def test_every_zero_key_is_mapped_or_explained():
    """A new ZeroConfig field must be given a stage-3 meaning (or a reason it has none)."""
    no_stage3_meaning = {
        "elastic_checkpoint",
        "compute_grad_norm",
        "legacy_stage1",
        "parameter_alignment",
        "save_muon_momentum_buffer_in_memory",
        "zenflow",
        "mics_shard_size",
        "mics_hierarchical_params_gather",
    }
    for name in ZeroConfig.model_fields:
        assert name in KEY_NOTES or name in no_stage3_meaning, f"zero_optimization.{name} has no stage-3 note"


def test_notes_for_explain():
    resolved = load_config(
        {"train_batch_size": 2, "zero_optimization": {"stage": 3, "memory_efficient_linear": False}}
    )
    notes = engine_notes(resolved.flat(), 3)
    assert notes["zero_optimization.stage3_prefetch_bucket_size"].startswith("FSDP2 explicit prefetch")
    inert = inert_keys(resolved.flat(), 3, only={"zero_optimization.memory_efficient_linear"})
    assert list(inert) == ["zero_optimization.memory_efficient_linear"]
    assert key_note("zero_optimization.stage3_max_live_parameters", 2) == "stage-3 key: no effect at stage 2"
    assert key_note("zero_optimization.allgather_bucket_size", 2) is None
    assert key_note("aio.use_gds", 3).startswith("accepted, no effect")
    assert key_note("train_batch_size", 3) is None


def test_settings_from_config():
    zero = ZeroConfig(
        stage=3,
        stage3_param_persistence_threshold=10,
        stage3_allgather_sequential=True,
        leaf_module={"classes": ["Expert"], "names": ["moe"]},
        zero_hpz_partition_size=2,
    )
    s = settings_from_zero(zero)
    assert (s.persistence_threshold, s.prefetch_disabled, s.hpz_partition_size) == (10, True, 2)
    assert s.leaf_classes == ("Expert",) and s.leaf_names == ("moe",)


# --------------------------------------------------------------------------- wrap policy
class _Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        return self.b(self.a(x))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 8)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3))
        self.moe = _Expert()
        self.big = nn.Linear(8, 64)
        self.head = nn.Linear(8, 100, bias=False)
        self.head.weight = self.embed.weight


def test_units_are_blocks_leaves_and_leaf_modules_never_split_ties():
    net = _Net()
    nodes = describe_modules(net)
    from shardwise.zero.wrap_policy import WrapRules

    units = choose_units(nodes, WrapRules(leaf_unit_min_numel=500, leaf_classes=("_Expert",)))
    # the tied embedding/head stay with the root; blocks, the expert and the big leaf are units
    assert units == ["layers.0", "layers.1", "layers.2", "moe", "big"]
    assert not nodes["embed"].confined and not nodes["head"].confined
    units = choose_units(nodes, WrapRules(leaf_unit_min_numel=10**9))
    assert units == ["layers.0", "layers.1", "layers.2"]
    units = choose_units(nodes, WrapRules(leaf_unit_min_numel=10**9, granularity_threshold=100))
    assert "moe" in units  # 144 elements over 2 descendants < 100 per descendant
    external = describe_modules(net, external=[net.big.weight])
    assert "big" not in choose_units(external, WrapRules(leaf_unit_min_numel=500))


def test_reshard_and_prefetch_plans():
    assert reshard_plan([10, 10, 10], 10**9, 10**9) == [False, False, False]
    assert reshard_plan([10, 10, 10], 15, 10**9) == [True, True, False]
    assert reshard_plan([10, 10, 10], 10**9, 0) == [True, True, False]
    assert prefetch_plan([5, 5, 5], 10**9) == [2, 1, 0]
    assert prefetch_plan([5, 5, 5], 0) == [0, 0, 0]


# --------------------------------------------------------------------------- offload store
def test_sub_groups_and_ratio():
    assert split_sub_groups([4, 4, 4], 8) == [[0, 1], [2]]
    assert split_sub_groups([10], 3) == [[0]]
    assert offloaded_prefix([1, 1, 1, 1], 0.0) == 0
    assert offloaded_prefix([3, 1], 0.5) == 0


def _adamw_pair(spec: OffloadSpec, steps: int = 3):
    torch.manual_seed(0)
    ref = [torch.randn(50), torch.randn(7, 3), torch.randn(11)]
    dev = [t.clone() for t in ref]
    ref_opt = torch.optim.AdamW(ref, lr=0.1, weight_decay=0.01)
    store = OffloadStore([{"params": dev[:2], "lr": 0.1}, {"params": dev[2:], "lr": 0.1}], spec)
    opt = OffloadedOptimizer(torch.optim.AdamW(store.host_groups, lr=0.1, weight_decay=0.01), store)
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        for r, d in zip(ref, dev):
            g = torch.randn(r.shape, generator=gen)
            r.grad, d.grad = g.clone(), g.clone()
        ref_opt.step()
        opt.step()
    return ref, dev, store, opt


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_offloaded_adamw_is_bitwise_the_plain_one(tmp_path: Path, device):
    spec = OffloadSpec(
        device=device,
        nvme_path=tmp_path if device == "nvme" else None,
        sub_group_size=40,
        buffer_count=2,
        pipeline_read=True,
        pipeline_write=True,
        aio=AioSettings(block_size=64, queue_depth=2),
    )
    ref, dev, store, opt = _adamw_pair(spec)
    for r, d in zip(ref, dev):
        assert torch.equal(r, d)
    assert store.sub_groups == [[0], [1, 2]]
    host = [store.host[i] for i in range(3)]
    assert all(h.data_ptr() != d.data_ptr() for h, d in zip(host, dev))  # real staging copies
    if device == "nvme":
        # between steps no state is in memory: placeholders, and the values are in the file
        for h in host:
            state = opt.state[h]
            assert state["exp_avg"].numel() == 0 and state["exp_avg_sq"].numel() == 0
            assert h.untyped_storage().nbytes() == 0
        assert store.swap_path.stat().st_size >= 2 * 4 * (50 + 21 + 11)
        full = opt.state_dict()  # read back for checkpoints
        assert full["state"][0]["exp_avg"].shape == (50,)
        assert opt.state[host[0]]["exp_avg"].numel() == 0  # and evicted again
        assert store.state_bytes(opt.inner)["host"] == 0
    else:
        assert opt.state[host[0]]["exp_avg"].shape == (50,)
        assert store.state_bytes(opt.inner)["host"] >= 3 * 4 * 82  # state + staging masters
    store.close()


def test_partial_offload_steps_the_rest_on_the_device():
    ref, dev, store, _ = _adamw_pair(OffloadSpec(device="cpu", ratio=0.7))
    assert store.offloaded == 1 and store.host[1] is dev[1] and store.host[2] is dev[2]
    for r, d in zip(ref, dev):
        assert torch.equal(r, d)


def test_swap_file_round_trip_in_blocks(tmp_path):
    f = SwapFile(tmp_path, "t", AioSettings(block_size=10, queue_depth=4, intra_op_parallelism=2))
    data = torch.arange(1000, dtype=torch.bfloat16)
    offset = f.allocate(2000)
    f.write(data, offset).wait()
    back = torch.empty_like(data)
    f.read(back, offset).wait()
    assert torch.equal(back, data)
    f.close()
    assert not (tmp_path / "t.swp").exists()
