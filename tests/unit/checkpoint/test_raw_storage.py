"""Raw-bytes DCP storage: exact round trips, partial reads, old torch.save checkpoints, damage."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from shardwise.checkpoint import dcp_io
from shardwise.checkpoint.dcp_io import FlatShards
from shardwise.checkpoint.raw_storage import RAW_DESCRIPTOR

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state() -> dict[str, object]:
    gen = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(5, 7, generator=gen),
        "half": torch.randn(3, 4, generator=gen).to(torch.bfloat16),
        "ids": torch.arange(11, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.empty(0, 3),
        "strided": torch.randn(4, 6, generator=gen).t(),  # not contiguous when saved
        "meta": {"step": 3, "name": "x"},
    }


def _empty_like(state: dict[str, object]) -> dict[str, object]:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in state.items()}


def test_every_dtype_and_shape_round_trips_bit_exactly(tmp_path: Path) -> None:
    state = _state()
    dcp_io.save(dict(state), tmp_path, no_dist=True)
    targets = _empty_like(state)
    dcp_io.load(targets, tmp_path, no_dist=True)
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            assert targets[key].dtype == value.dtype and torch.equal(targets[key], value), key
        else:
            assert targets[key] == value


def test_tensors_are_stored_as_raw_bytes_with_the_descriptor(tmp_path: Path) -> None:
    state = _state()
    dcp_io.save(dict(state), tmp_path, no_dist=True)
    metadata = dcp_io.read_metadata(tmp_path)
    raw = {idx.fqn: info for idx, info in metadata.storage_data.items() if info.transform_descriptors}
    assert set(raw) == {k for k, v in state.items() if isinstance(v, torch.Tensor)}
    w = raw["w"]
    assert w.transform_descriptors == [RAW_DESCRIPTOR] and w.length == 5 * 7 * 4
    blob = (tmp_path / w.relative_path).read_bytes()[w.offset : w.offset + w.length]
    assert torch.equal(torch.frombuffer(bytearray(blob), dtype=torch.float32).view(5, 7), state["w"])


def test_reads_of_part_of_a_chunk_and_across_chunks(tmp_path: Path) -> None:
    """Saved as two flat pieces, read back as other pieces: the reader narrows inside each stored chunk."""
    full = torch.arange(48.0).view(6, 8)
    flat = full.reshape(-1)
    dcp_io.save(
        {"t": FlatShards((6, 8), torch.float32, [(0, 21, flat[0:21].clone()), (21, 48, flat[21:].clone())])},
        tmp_path,
        no_dist=True,
    )
    out = torch.zeros(48)
    target = FlatShards((6, 8), torch.float32, [(5, 30, out[5:30]), (40, 47, out[40:47])])
    dcp_io.load({"t": target}, tmp_path, no_dist=True)
    expected = torch.zeros(48)
    expected[5:30], expected[40:47] = flat[5:30], flat[40:47]
    assert torch.equal(out, expected)


def test_checkpoints_written_with_torch_save_items_still_load(tmp_path: Path) -> None:
    """DCP's own writer (and shardwise before the raw format) stores each tensor with torch.save."""
    state = _state()
    dcp.save(
        dict(state),
        storage_writer=FileSystemWriter(str(tmp_path)),
        planner=dcp_io.ShardSavePlanner(),
        no_dist=True,
    )
    metadata = dcp_io.read_metadata(tmp_path)
    assert not any(info.transform_descriptors for info in metadata.storage_data.values())
    targets = _empty_like(state)
    dcp_io.load(targets, tmp_path, no_dist=True)
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(targets[key], value), key
    assert targets["meta"] == state["meta"]
    assert torch.equal(dcp_io.StreamingReader(tmp_path).read("w"), state["w"])


def test_streaming_reader_reads_raw_items(tmp_path: Path) -> None:
    state = _state()
    dcp_io.save(dict(state), tmp_path, no_dist=True)
    reader = dcp_io.StreamingReader(tmp_path)
    assert torch.equal(reader.read("half"), state["half"]) and reader.read("meta") == state["meta"]


def test_a_stock_dcp_reader_names_the_extension_it_lacks(tmp_path: Path) -> None:
    dcp_io.save({"w": torch.ones(3)}, tmp_path, no_dist=True)
    with pytest.raises(BaseException, match=RAW_DESCRIPTOR.replace(".", r"\.")):
        dcp.load({"w": torch.zeros(3)}, storage_reader=FileSystemReader(str(tmp_path)), no_dist=True)


def test_a_truncated_file_is_an_error_naming_the_file(tmp_path: Path) -> None:
    dcp_io.save({"w": torch.ones(1000)}, tmp_path, no_dist=True)
    data_file = next(tmp_path.glob("*.distcp"))
    data_file.write_bytes(data_file.read_bytes()[:100])
    with pytest.raises(RuntimeError, match=rf"{data_file.name} is truncated"):
        dcp_io.load({"w": torch.zeros(1000)}, tmp_path, no_dist=True)


def test_several_writer_threads_spread_items_over_files(tmp_path: Path) -> None:
    state = _state()
    dcp_io.save(dict(state), tmp_path, no_dist=True, thread_count=3)
    assert len(list(tmp_path.glob("*.distcp"))) == 3
    targets = _empty_like(state)
    dcp_io.load(targets, tmp_path, no_dist=True)
    assert all(torch.equal(targets[k], v) for k, v in state.items() if isinstance(v, torch.Tensor))
