"""Small DeepSpeed names: required_torch_version, parse_range_list, OnDevice, git_version_info, the LR-schedule
constants, zero_to_fp32's file helpers, DeepSpeed checkpoint file names."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardwise.compat import git_version_info, lr_schedules
from shardwise.compat.ds_utils import get_model_ckpt_name_for_rank, get_zero_ckpt_name_for_rank
from shardwise.compat.small_names import OnDevice, parse_range_list, required_torch_version
from shardwise.compat.zero_to_fp32 import get_model_state_files, get_optim_files


def test_required_torch_version() -> None:
    major, minor = (int(p) for p in torch.__version__.split(".")[:2])
    assert required_torch_version(min_version=1.8)
    assert required_torch_version(min_version=f"{major}.{minor}", max_version=f"{major}.{minor}.99")
    assert not required_torch_version(max_version="1.0") and not required_torch_version(min_version=f"{major + 1}")


def test_parse_range_list() -> None:
    assert parse_range_list("0,2-4,6,8-9") == [0, 2, 3, 4, 6, 8, 9]
    for bad in ("0,2-6,5-9", "8,2-6", "1,6-2", "a"):
        with pytest.raises(ValueError):
            parse_range_list(bad)


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_on_device(device: str) -> None:
    with OnDevice(dtype=torch.half, device=device):
        layer = torch.nn.Linear(2, 2)
    assert layer.weight.device == torch.device(device) and layer.weight.dtype == torch.half
    assert torch.get_default_dtype() == torch.float32
    with OnDevice(dtype=torch.half, device="meta", enabled=False):
        assert torch.nn.Linear(2, 2).weight.dtype == torch.float32


def test_git_version_info() -> None:
    assert git_version_info.version == "0.19.8"
    assert git_version_info.torch_info["version"] == ".".join(torch.__version__.split(".")[:2])
    assert git_version_info.compatible_ops["cpu_adam"] and not any(git_version_info.installed_ops.values())


def test_lr_schedule_constants_and_start_lr() -> None:
    assert (lr_schedules.WARMUP_LR, lr_schedules.ONE_CYCLE, lr_schedules.WARMUP_TYPE) == ("WarmupLR", "OneCycle", "warmup_type")
    assert lr_schedules.get_lr_from_config({"type": "WarmupLR", "params": {"warmup_max_lr": 0.1}}) == (0.1, "")
    assert lr_schedules.get_lr_from_config({"type": "Nope", "params": {}})[0] is None


def test_checkpoint_file_helpers(tmp_path: Path) -> None:
    for i in (10, 2, 1):
        (tmp_path / f"zero_{i}_optim_states.pt").write_text("x")
    assert [Path(f).name for f in get_optim_files(tmp_path)] == [f"zero_{i}_optim_states.pt" for i in (1, 2, 10)]
    with pytest.raises(FileNotFoundError, match="model_states"):
        get_model_state_files(tmp_path)
    assert get_model_ckpt_name_for_rank("ck", "00") == "ck/mp_rank_00_model_states.pt"
    assert get_zero_ckpt_name_for_rank("ck", 3, 0) == "ck/zero_pp_rank_3_mp_rank_00_optim_states.pt"
