"""fsdp_internals.unit_param_groups across torch's two FSDPState layouts (2.13's list, 2.11's one
optional group), and NVMe parameter offload's refusal where torch cannot exchange storages."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from shardwise.comm.fsdp_internals import unit_param_groups
from shardwise.zero import param_swap
from shardwise.zero.offload import OffloadSpec


class _Unit:
    def __init__(self, state: object) -> None:
        self._state = state

    def _get_fsdp_state(self) -> object:
        return self._state


def test_param_groups_read_from_either_state_layout():
    group = object()
    assert unit_param_groups(_Unit(SimpleNamespace(_fsdp_param_groups=(group,)))) == [group]  # type: ignore[arg-type]
    assert unit_param_groups(_Unit(SimpleNamespace(_fsdp_param_group=group))) == [group]  # type: ignore[arg-type]
    assert unit_param_groups(_Unit(SimpleNamespace(_fsdp_param_group=None))) == []  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match=r"_fsdp_param_groups .*_fsdp_param_group .*torch 2.11"):
        unit_param_groups(_Unit(SimpleNamespace()))  # type: ignore[arg-type]


def test_nvme_param_offload_names_the_torch_it_needs(tmp_path, monkeypatch):
    monkeypatch.setattr(param_swap, "storage_exchange_available", lambda: False)
    spec = OffloadSpec(device="nvme", nvme_path=tmp_path, buffer_count=2)
    with pytest.raises(RuntimeError, match=r"offload_param.device='nvme'.*_swap_data_ptr_.*torch 2.13"):
        param_swap.ParamSwapper(spec, rank=0)
    assert not list(tmp_path.rglob("*")), "nothing is created before the refusal"
