"""Megatron's memory-mapped indexed dataset: shardwise's writer produces DeepSpeed's bytes and its reader
reads them as DeepSpeed's does.

Facts from DeepSpeed 0.19.8 (``MMapIndexedDatasetBuilder(..., dtype=np.int32)`` with items [7, 8] and
[9, 10, 11], one ``end_document()``): the ``.idx`` bytes below; its ``MMapIndexedDataset`` reads items
[1, 2, 3], [4], [5, 6] (documents [0, 2, 3]) as ``get(0, 1, 1) == [2]``, ``get(0, 1) == [2, 3]``,
``sizes == [3, 1, 2]``, and an empty slice ``d[1:1]`` as one empty array.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest

from shardwise.data.mmap_indexed import (
    MEGATRON_DTYPES,
    MMapIndexedDataset,
    MMapIndexedDatasetBuilder,
)

DEEPSPEED_IDX = bytes.fromhex(
    "4d4d4944494458000001000000000000000402000000000000000200000000000000020000000300000000000000000000000800"
    "00000000000000000000000000000200000000000000"
)


def _write(prefix: Path, items: list[list[int]], dtype: object, docs: list[int], **kwargs: object) -> None:
    builder = MMapIndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype, **kwargs)  # type: ignore[arg-type]
    for i, item in enumerate(items):
        builder.add_item_numpy(np.array(item))
        if i + 1 in docs:
            builder.end_document()
    builder.finalize(f"{prefix}.idx")


def test_the_index_is_deepspeeds_bytes_and_the_data_its_elements(tmp_path: Path) -> None:
    _write(tmp_path / "d", [[7, 8], [9, 10, 11]], np.int32, [2])
    assert (tmp_path / "d.idx").read_bytes() == DEEPSPEED_IDX
    assert np.frombuffer((tmp_path / "d.bin").read_bytes(), dtype=np.int32).tolist() == [7, 8, 9, 10, 11]


@pytest.mark.parametrize("dtype", [np.uint8, np.int32, np.int64, np.uint16])
def test_reads_items_slices_and_parts(tmp_path: Path, dtype: type) -> None:
    _write(tmp_path / "d", [[1, 2, 3], [4], [5, 6]], dtype, [2, 3])
    data = MMapIndexedDataset(str(tmp_path / "d"))  # with the warm-up read
    assert len(data) == 3 and data.dtype is dtype
    assert [data[i].tolist() for i in range(3)] == [[1, 2, 3], [4], [5, 6]]
    assert data[np.int64(2)].tolist() == [5, 6]
    assert [a.tolist() for a in data[0:3]] == [[1, 2, 3], [4], [5, 6]]
    assert [a.tolist() for a in data[1:1]] == [[]]
    assert data.get(0, 1, 1).tolist() == [2] and data.get(0, 1).tolist() == [2, 3]
    assert data.sizes.tolist() == [3, 1, 2] and data.size(2) == 2 and data.doc_idx.tolist() == [0, 2, 3]
    assert MMapIndexedDataset.exists(str(tmp_path / "d")) and not MMapIndexedDataset.exists(str(tmp_path / "e"))
    again = pickle.loads(pickle.dumps(data))  # DataLoader workers get the path and reopen the maps
    assert again[0].tolist() == [1, 2, 3]
    with pytest.raises(ValueError, match="contiguous"):
        data[0:3:2]


def test_megatrons_type_codes_and_bad_files(tmp_path: Path) -> None:
    _write(tmp_path / "m", [[65000, 1]], np.uint16, [1], dtype_codes=MEGATRON_DTYPES)
    assert (tmp_path / "m.idx").read_bytes()[17] == 8  # Megatron's code for uint16 (DeepSpeed's is 6)
    assert MMapIndexedDataset(str(tmp_path / "m"), skip_warmup=True, dtype_codes=MEGATRON_DTYPES)[0].tolist() == [65000, 1]
    (tmp_path / "bad.idx").write_bytes(b"TNTIDX\x00\x00" + bytes(20))
    (tmp_path / "bad.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="not a memory-mapped indexed dataset"):
        MMapIndexedDataset(str(tmp_path / "bad"), skip_warmup=True)
    with pytest.raises(ValueError, match="no code"):
        MMapIndexedDatasetBuilder(str(tmp_path / "f.bin"), dtype=np.float32)
