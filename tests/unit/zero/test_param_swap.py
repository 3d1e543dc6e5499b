"""ParamSwapper (stage 3's NVMe parameters, storage by storage) and MappedStash (zero.Init's files)."""

from __future__ import annotations

from pathlib import Path

import torch

from shardwise.zero.nvme import AioSettings, MappedStash
from shardwise.zero.offload import OffloadSpec
from shardwise.zero.param_swap import ParamSwapper, SwappedMasters


def _param(values: torch.Tensor) -> torch.Tensor:
    """What the swapper reads from a sharded parameter is its local tensor
    (``comm.fsdp_internals.local_tensor``), which for a plain tensor is the tensor itself."""
    return values


def _swapper(tmp_path: Path, *tensors: torch.Tensor) -> ParamSwapper:
    spec = OffloadSpec(device="nvme", nvme_path=tmp_path, buffer_count=2)
    return ParamSwapper(spec, rank=0, params=[_param(t) for t in tensors])  # type: ignore[arg-type]


def test_evict_maps_the_file_and_restore_reads_it_back(tmp_path):
    a, b = torch.arange(3000.0), torch.arange(5.0) * -1
    swapper = _swapper(tmp_path, a, b)
    view = a[10:20]  # views follow the storage through both exchanges
    swapper.evict()
    assert swapper.is_mapped(a) and swapper.is_mapped(view) and not swapper.resident
    assert torch.equal(a, torch.arange(3000.0)) and torch.equal(view, torch.arange(10.0, 20.0))
    swapper.restore([swapper.index_of(b)])
    assert swapper.is_mapped(a) and not swapper.is_mapped(b)
    swapper.restore()
    assert swapper.resident and torch.equal(b, torch.arange(5.0) * -1)
    swapper.close()


def test_released_pages_drop_edits_made_through_the_map(tmp_path):
    a = torch.zeros(4096)
    swapper = _swapper(tmp_path, a)
    swapper.evict()
    a.add_(1.0)  # an edit outside GatheredParameters: copy-on-write pages, not the file
    assert float(a.sum()) == 4096.0
    swapper.drop_pages([0])
    assert float(a.sum()) == 0.0
    swapper.close()


def test_a_restored_storage_written_and_evicted_again_updates_the_file(tmp_path):
    a = torch.zeros(1000)
    swapper = _swapper(tmp_path, a)
    swapper.evict()
    masters = SwappedMasters(swapper, [a[:500], a[500:]])  # two views of one storage: one transfer
    for pending in masters.load([0, 1]):
        pending.wait()
    assert not swapper.is_mapped(a)
    a.fill_(7.0)  # the optimizer step
    saves = masters.save([1])
    assert len(saves) == 1
    saves[0].wait()
    assert swapper.is_mapped(a)
    swapper.drop_pages([0])  # nothing stale left in memory: the values come from the file
    assert torch.equal(a, torch.full((1000,), 7.0))
    swapper.close()


def test_mapped_stash_keeps_values_after_the_file_is_sealed(tmp_path):
    stash = MappedStash(tmp_path / "init", AioSettings())
    original = torch.randn(300, 7)
    mapped, mapping = stash.put(original)
    assert mapping is not None and torch.equal(mapped, original)
    assert mapped.data_ptr() != original.data_ptr()
    stash.seal()
    assert not (tmp_path / "init").exists()
    assert torch.equal(mapped, original)
