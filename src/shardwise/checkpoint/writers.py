"""Write a state dict to one file, tensor by tensor: safetensors or ``torch.load``-able.

``torch.save`` and ``safetensors.torch.save_file`` both need every tensor in memory at
once, which is what makes consolidating large checkpoints run out of RAM. Both formats put
all shapes and offsets *before* the data, and shapes are known from the checkpoint metadata,
so the header can be written first and each tensor appended as it is read, then dropped:
peak memory is about the largest tensor.

* safetensors: an 8-byte little-endian header length, a JSON header (dtype, shape and byte
  offsets per tensor), then the raw bytes; written here directly, so the ``safetensors``
  package is not needed to *write* (it reads these files).
* ``pt``: torch's zip format, the same records ``torch.save`` writes (``data.pkl``, then one
  ``data/<i>`` record per tensor), through torch's own zip writer. The pickle references
  storages by key only, so it can be written before any tensor data.

Files appear atomically (a temporary name, fsync, rename) and are refused if they would be
empty or if a tensor arrives with a shape or dtype other than announced.
"""

from __future__ import annotations

import collections
import io
import json
import math
import os
import pickle
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}

Spec = tuple[tuple[int, ...], torch.dtype]


def _nbytes(spec: Spec) -> int:
    shape, dtype = spec
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def _raw(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy (contiguous CPU tensors)."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]


def _checked(
    specs: Mapping[str, Spec], tensors: Iterable[tuple[str, torch.Tensor]]
) -> Iterable[torch.Tensor]:
    """Tensors in announced order, each checked against its announced shape and dtype."""
    order = list(specs)
    count = 0
    for key, tensor in tensors:
        if count >= len(order) or key != order[count]:
            expected = order[count] if count < len(order) else "nothing more"
            raise ValueError(f"tensors arrived out of order: got {key!r}, expected {expected!r}")
        shape, dtype = specs[key]
        if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
            raise ValueError(
                f"{key}: announced {tuple(shape)} {dtype}, got {tuple(tensor.shape)} {tensor.dtype}; the source changed"
            )
        count += 1
        yield tensor
    if count != len(order):
        raise ValueError(f"only {count} of {len(order)} tensors arrived; missing from {order[count]!r} on")


def _safetensors_header(specs: Mapping[str, Spec], metadata: Mapping[str, str] | None) -> bytes:
    header: dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for key, spec in specs.items():
        shape, dtype = spec
        if dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"{key}: dtype {dtype} cannot be stored in safetensors")
        size = _nbytes(spec)
        header[key] = {
            "dtype": SAFETENSORS_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    return text + b" " * (-len(text) % 8)  # data starts 8-byte aligned


def _write_safetensors(
    path: Path, specs: Mapping[str, Spec], tensors: Iterable[tuple[str, torch.Tensor]], metadata: Any
) -> int:
    header = _safetensors_header(specs, metadata)
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(header)))
        handle.write(header)
        for tensor in _checked(specs, tensors):
            handle.write(_raw(tensor))
        handle.flush()
        os.fsync(handle.fileno())
    return 8 + len(header) + sum(_nbytes(s) for s in specs.values())


class _StorageRef:
    """Stands for a tensor's storage in the pickle; torch's loader resolves it by key."""

    def __init__(self, key: str, dtype: torch.dtype, numel: int) -> None:
        self.key, self.dtype, self.numel = key, dtype, numel


class _TensorRef:
    """Pickles exactly as a contiguous CPU tensor does, without holding its data."""

    def __init__(self, storage: _StorageRef, shape: tuple[int, ...]) -> None:
        self.storage, self.shape = storage, shape

    def __reduce_ex__(self, protocol: object) -> Any:
        stride = tuple(math.prod(self.shape[i + 1 :]) for i in range(len(self.shape)))
        args: tuple[object, ...] = (
            self.storage,
            0,
            torch.Size(self.shape),
            stride,
            False,
            collections.OrderedDict(),
        )
        return (torch._utils._rebuild_tensor_v2, args)


def _storage_class(dtype: torch.dtype) -> object:
    """The legacy storage class torch's pickles name for ``dtype`` (e.g. ``torch.FloatStorage``)."""
    return getattr(torch, torch.storage._dtype_to_storage_type_map()[dtype])


def _write_pt(path: Path, specs: Mapping[str, Spec], tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    refs = {
        key: _TensorRef(_StorageRef(str(i), dtype, math.prod(shape)), tuple(shape))
        for i, (key, (shape, dtype)) in enumerate(specs.items())
    }

    class _Pickler(pickle.Pickler):
        def persistent_id(self, obj: object) -> Any:
            if isinstance(obj, _StorageRef):
                return ("storage", _storage_class(obj.dtype), obj.key, "cpu", obj.numel)
            return None

    buffer = io.BytesIO()
    _Pickler(buffer, protocol=2).dump(collections.OrderedDict(refs))
    data = buffer.getvalue()
    writer = torch._C.PyTorchFileWriter(str(path))
    writer.write_record("data.pkl", data, len(data))
    writer.write_record(".format_version", b"1", 1)
    writer.write_record("byteorder", b"little", len("little"))
    for (key, ref), tensor in zip(refs.items(), _checked(specs, tensors)):
        compact = tensor.detach().cpu().contiguous().clone() if tensor.numel() else tensor.detach().cpu()
        writer.write_record(f"data/{ref.storage.key}", compact.untyped_storage(), compact.nbytes)  # type: ignore[arg-type]
        del key
    writer.write_end_of_file()
    with open(path, "rb+") as handle:
        os.fsync(handle.fileno())
    return os.path.getsize(path)


def write_state_dict(
    path: str | os.PathLike[str],
    specs: Mapping[str, Spec],
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    fmt: str = "safetensors",
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Stream ``tensors`` into one file at ``path``, atomically.

    Args:
        path: the output file.
        specs: ``name -> (shape, dtype)`` of every tensor, in the order they will arrive.
        tensors: ``(name, tensor)`` pairs in that order; each may be freed after it is yielded.
        fmt: ``"safetensors"`` or ``"pt"`` (readable by ``torch.load(..., weights_only=True)``).
        metadata: safetensors ``__metadata__`` strings.

    Raises:
        ValueError: nothing to write, an unknown format, or a tensor not matching its spec.

    Example:
        >>> import tempfile
        >>> t = torch.ones(2, 3)
        >>> out = write_state_dict(tempfile.mkdtemp() + "/m.safetensors", {"w": ((2, 3), t.dtype)}, [("w", t)])
        >>> out.stat().st_size > 24
        True
    """
    if not specs:
        raise ValueError(
            f"refusing to write {path}: the state dict is empty (an empty file is never a model)"
        )
    if fmt not in ("safetensors", "pt"):
        raise ValueError(f"unknown export format {fmt!r}: use 'safetensors' or 'pt'")
    out = Path(path)
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        if fmt == "safetensors":
            expected = _write_safetensors(tmp, specs, tensors, metadata)
            if os.path.getsize(tmp) != expected:
                raise OSError(f"{tmp} has {os.path.getsize(tmp)} bytes, expected {expected}")
        else:
            _write_pt(tmp, specs, tensors)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()
    return out


def read_safetensors(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Read a safetensors file (memory-mapped) without the ``safetensors`` package.

    Example:
        >>> import tempfile
        >>> out = write_state_dict(tempfile.mkdtemp() + "/m.safetensors", {"w": ((2,), torch.float32)},
        ...                        [("w", torch.ones(2))])
        >>> read_safetensors(out)["w"].tolist()
        [1.0, 1.0]
    """
    names = {v: k for k, v in SAFETENSORS_DTYPES.items()}
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    size = os.path.getsize(path)
    data = torch.from_file(os.fspath(path), shared=False, size=size, dtype=torch.uint8)
    start = 8 + length
    out: dict[str, torch.Tensor] = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        lo, hi = info["data_offsets"]
        dtype = names[info["dtype"]]
        out[key] = data[start + lo : start + hi].view(dtype).reshape(info["shape"])
    return out
