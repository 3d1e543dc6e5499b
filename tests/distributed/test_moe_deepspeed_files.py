"""A MoE checkpoint in DeepSpeed's own file layout, on 2 gloo ranks: a shardwise EP=2 save written by
``to-deepspeed`` as DeepSpeed's per-expert files (``layer_L_expert_E_...``, one ``expp_rank_R`` optimizer
file per expert-parallel rank) and read back by shardwise's DeepSpeed importer at EP=2 and EP=1 gives
every weight and Adam moment bitwise; the save itself holds DeepSpeed's MoE model files too. (Real DeepSpeed 0.19.8 loading these files, and shardwise
loading DeepSpeed's: ``benchmarks/moe_checkpoint_interop.py``.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from moe_cases import EXPERTS, LAYERS, deepspeed_format_round_trip

from shardwise.checkpoint import keys
from shardwise.checkpoint.deepspeed_import import load_file
from shardwise.checkpoint.integrity import verify_tag
from shardwise.checkpoint.universal_write import read_full_checkpoint
from shardwise.compat.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from shardwise.testing import run_distributed_cases

pytestmark = pytest.mark.distributed


def test_deepspeed_moe_files_round_trip_at_both_expert_parallel_sizes(tmp_path: Path) -> None:
    root = str(tmp_path)
    cases = [{"action": "save", "ep": 2, "root": root}] + [{"action": "load", "ep": ep, "root": root} for ep in (2, 1)]
    bf16 = str(tmp_path / "bf16")  # DeepSpeed's fused 16-bit wrapper: flat fp32 masters and moments per group
    cases += [{"action": "save", "ep": 2, "root": bf16, "bf16": True}, {"action": "load", "ep": 1, "root": bf16, "bf16": True}]
    run_distributed_cases(deepspeed_format_round_trip, cases, world_size=2, timeout=300)

    for ep in (2, 1):  # DeepSpeed's layout on disk
        tag = tmp_path / f"ds_ep{ep}" / "t2"
        names = sorted(p.name for p in tag.iterdir())
        experts = [f"layer_{lay}_expert_{e}_mp_rank_00_model_states.pt" for lay in range(LAYERS) for e in range(EXPERTS)]
        optim = [f"expp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(ep)]
        assert names == sorted([*experts, *optim, "mp_rank_00_model_states.pt"])
        main = load_file(tag / "mp_rank_00_model_states.pt")
        assert main["num_experts"] == [EXPERTS] * LAYERS
        assert not any("deepspeed_experts" in k for k in main["module"])
        assert len(load_file(tag / optim[-1])["optimizer"]["param_groups"]) == 2  # dense, then the experts

    # engine.save_checkpoint wrote DeepSpeed's MoE model files next to its own, checksummed with them
    saved = tmp_path / "shardwise" / "t2"
    assert verify_tag(saved).status == "ok"
    main = load_file(saved / "mp_rank_00_model_states.pt")
    assert main["num_experts"] == [EXPERTS] * LAYERS and main["ds_autoep_layers"] is None
    got_experts: dict[str, torch.Tensor] = {}
    for lay in range(LAYERS):
        for e in range(EXPERTS):
            got_experts.update(load_file(saved / f"layer_{lay}_expert_{e}_mp_rank_00_model_states.pt"))

    want = read_full_checkpoint(saved)
    expert_tensors = [k for k in want["module"] if "deepspeed_experts" in k]
    assert len(expert_tensors) == LAYERS * EXPERTS * 4  # every rank's experts
    assert sorted(got_experts) == sorted(expert_tensors)
    # zero_to_fp32 / `shardwise checkpoint export` of it hold every rank's experts too
    exported = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "shardwise"))
    assert sorted(exported) == sorted(want["module"])
    for name in expert_tensors:
        assert torch.equal(got_experts[name], want["module"][name]), name
    for name, tensor in main["module"].items():
        assert torch.equal(tensor, want["module"][name]), name
    for ep in (2, 1):
        got = read_full_checkpoint(tmp_path / f"back_ep{ep}" / "t2")
        for name, tensor in want["module"].items():
            assert torch.equal(got["module"][name], tensor), (ep, name)
        moments = [k for k in want["optimizer"] if k.startswith(keys.OPTIM) and k.endswith(("/exp_avg", "/exp_avg_sq"))]
        assert len(moments) == 2 * len(want["module"])  # one pair per tensor (the model has no buffers)
        for key in moments:
            assert torch.equal(got["optimizer"][key], want["optimizer"][key]), (ep, key)

    want = read_full_checkpoint(tmp_path / "bf16" / "shardwise" / "t2")
    got = read_full_checkpoint(tmp_path / "bf16" / "back_ep1" / "t2")
    assert "fp32_groups_flat" in load_file(tmp_path / "bf16" / "ds_ep1" / "t2" / "expp_rank_0_mp_rank_00_optim_states.pt")["optimizer"]
    saved = [k for k in want["optimizer"] if k.startswith((keys.MASTER, keys.OPTIM)) and k != keys.PARAM_GROUPS]
    assert any("deepspeed_experts.3" in k for k in saved) and any(k.startswith(keys.MASTER) for k in saved)
    for key in saved:
        if not key.endswith("/step"):
            assert torch.equal(got["optimizer"][key], want["optimizer"][key]), ("bf16", key)
