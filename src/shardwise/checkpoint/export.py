"""Getting weights out: streaming export to one file, a full state dict, and ``info``.

The replacement for DeepSpeed's ``zero_to_fp32.py``: it reads a checkpoint of any stage and
world size one tensor at a time and streams each into the output file
(:mod:`~shardwise.checkpoint.writers`), so the process holds about one tensor, not the model.
Trainable parameters come from the fp32 masters when the checkpoint has them (16-bit
training), so an fp32 export is exact; frozen parameters and buffers are included.

Example:
    >>> # shardwise checkpoint export ckpts/ model.safetensors --dtype bf16
    >>> # export_checkpoint("ckpts", "model.safetensors", dtype="bf16")
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from shardwise.checkpoint import integrity, keys, layout
from shardwise.checkpoint.dcp_io import StreamingReader

EXPORT_DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


class TensorSource:
    """A checkpoint's module tensors, readable one at a time: shardwise or DeepSpeed.

    Attributes:
        specs: ``name -> (shape, saved dtype)`` in module order.
    """

    def __init__(self, tag_dir: Path, *, exclude_frozen: bool = False) -> None:
        self.tag_dir = tag_dir
        self.kind = layout.detect_kind(tag_dir)
        if self.kind in ("deepspeed", "universal"):
            from shardwise.checkpoint.deepspeed_import import DeepSpeedCheckpoint
            from shardwise.checkpoint.universal_read import UniversalCheckpoint

            self._ds = (DeepSpeedCheckpoint if self.kind == "deepspeed" else UniversalCheckpoint)(tag_dir)
            self.specs = self._ds.module_specs(exclude_frozen=exclude_frozen)
            return
        if self.kind != "shardwise":
            raise FileNotFoundError(f"{tag_dir} is not a checkpoint")
        self._reader = StreamingReader(tag_dir)
        summary = layout.read_summary(tag_dir)
        if int(summary.get("mp_world_size", 1)) > 1:
            raise ValueError(
                f"{tag_dir} holds tensor-parallel shards (mp size > 1); export each mp rank's model"
            )
        entries = self._reader.entries
        saved = [k[len(keys.MODEL) :] for k in entries if k.startswith(keys.MODEL)]
        # module_keys is the publishing rank's; under expert parallelism the other ranks' experts follow
        order = list(dict.fromkeys([*(summary.get("module_keys") or []), *saved]))
        frozen = set(summary.get("frozen", []))
        self._aliases: dict[str, str] = summary.get("aliases", {})
        self.specs = {}
        for name in order:
            if exclude_frozen and name in frozen:
                continue
            entry = entries.get(keys.model_key(name))
            if entry is None or not entry.is_tensor:
                continue
            self.specs[name] = (tuple(entry.shape or ()), entry.dtype or torch.float32)

    def _source_key(self, name: str) -> str:
        canonical = self._aliases.get(name, name)
        return keys.fp32_source(canonical, self._reader.entries) or keys.model_key(name)

    def read(self, name: str) -> torch.Tensor:
        """The full tensor for a module entry (fp32 master for trainable parameters when saved)."""
        if self.kind in ("deepspeed", "universal"):
            return self._ds.read_module_tensor(name)
        return self._reader.read(self._source_key(name))

    def best_dtype(self, name: str) -> torch.dtype:
        """The dtype of the most precise saved copy of ``name``."""
        if self.kind in ("deepspeed", "universal"):
            return self._ds.best_dtype(name)
        return self._reader.entries[self._source_key(name)].dtype or self.specs[name][1]


def _target_dtype(saved: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    if dtype is None or not saved.is_floating_point:
        return saved
    return dtype


def export_checkpoint(
    checkpoint: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    tag: str | None = None,
    dtype: str | None = "fp32",
    fmt: str | None = None,
    exclude_frozen_parameters: bool = False,
) -> Path:
    """Write a checkpoint's model weights to one file, streaming tensor by tensor.

    Args:
        checkpoint: a save directory (its ``latest`` tag is used), or a tag directory; shardwise
            or DeepSpeed (any ZeRO stage, any world size).
        output: the file to write (``.safetensors``, ``.bin``, ``.pt``...), or a directory, which
            is any path without an extension (then ``model.safetensors`` or ``pytorch_model.bin``
            inside it).
        tag: a tag inside ``checkpoint`` instead of ``latest``.
        dtype: ``"fp32"``, ``"bf16"``, ``"fp16"`` for floating-point tensors, or None to keep the
            saved dtypes. Integer buffers keep theirs.
        fmt: ``"safetensors"`` or ``"pt"``; default from the file name (``.safetensors`` or not).
        exclude_frozen_parameters: leave out parameters that were frozen (``requires_grad=False``).

    Returns:
        The written file.

    Raises:
        ValueError: an unknown dtype/format, or a checkpoint without module weights.
        CheckpointIntegrityError: a file of the checkpoint is missing, truncated or damaged.

    Example:
        >>> # export_checkpoint("ckpts", "out/", dtype="bf16")   # -> out/model.safetensors
    """
    if dtype is not None and dtype not in EXPORT_DTYPES:
        raise ValueError(f"unknown export dtype {dtype!r}: use one of {sorted(set(EXPORT_DTYPES))}")
    target = EXPORT_DTYPES[dtype] if dtype is not None else None
    out = Path(output)
    if out.is_dir() or not out.suffix:  # a directory (existing, or a name without extension)
        out = out / ("pytorch_model.bin" if fmt == "pt" else "model.safetensors")
    fmt = fmt or ("safetensors" if out.suffix == ".safetensors" else "pt")
    tag_dir = layout.resolve(checkpoint, tag)
    integrity.require_intact(tag_dir)  # a damaged checkpoint is refused before anything is written
    source = TensorSource(tag_dir, exclude_frozen=exclude_frozen_parameters)
    if not source.specs:
        raise ValueError(f"{source.tag_dir} holds no module weights to export")
    specs = {name: (shape, _target_dtype(saved, target)) for name, (shape, saved) in source.specs.items()}

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for name, (_, want) in specs.items():
            tensor = source.read(name)
            yield name, tensor.to(want) if tensor.dtype != want else tensor
            del tensor

    from shardwise.checkpoint.writers import write_state_dict

    out.parent.mkdir(parents=True, exist_ok=True)
    metadata = {"format": "pt", "source": str(source.tag_dir), "exported_by": "shardwise"}
    return write_state_dict(out, specs, tensors(), fmt=fmt, metadata=metadata)


def load_full_state_dict(
    checkpoint: str | os.PathLike[str], *, tag: str | None = None, dtype: str | None = "fp32"
) -> dict[str, torch.Tensor]:
    """The model's full state dict from a checkpoint of any stage/world size, in memory.

    The in-memory counterpart of :func:`export_checkpoint` (DeepSpeed's
    ``get_fp32_state_dict_from_zero_checkpoint``); use the export for models that do not fit.

    Example:
        >>> # model.load_state_dict(load_full_state_dict("ckpts"))
    """
    target = EXPORT_DTYPES[dtype] if dtype is not None else None
    tag_dir = layout.resolve(checkpoint, tag)
    integrity.require_intact(tag_dir)
    source = TensorSource(tag_dir)
    return {
        name: source.read(name).to(_target_dtype(saved, target)) for name, (_, saved) in source.specs.items()
    }


def checkpoint_info(path: str | os.PathLike[str], *, verify: bool = False) -> dict[str, Any]:
    """What a save directory (or one tag directory) holds: tags, layout, sizes, integrity.

    Each tag's ``integrity`` is ``"ok"``, ``"damaged"`` (``problems`` says why) or
    ``"unverified"`` (saved without checksums). Without ``verify`` only the summary, DCP's
    index and every file's size are checked (truncated and missing files, not flipped bytes);
    with it every byte is checked against its checksum.

    Example:
        >>> # checkpoint_info("ckpts")["tags"][-1]["zero_stage"]
    """
    root = Path(path)
    latest = None if layout.detect_kind(root) else (layout.read_latest(root) or layout.read_latest(root, layout.LATEST_UNIVERSAL))
    tags = []
    for tag_dir in integrity.tag_dirs(root):
        kind = layout.detect_kind(tag_dir)
        verdict = integrity.verify_tag(tag_dir, read=integrity.read_all if verify else integrity.read_none)
        info: dict[str, object] = {"tag": tag_dir.name, "kind": kind, "bytes": layout.dir_bytes(tag_dir)}
        info.update(integrity=verdict.status, problems=verdict.problems, checked=verdict.detail)
        index_damaged = any(p.startswith((layout.SUMMARY, layout.DCP_METADATA)) for p in verdict.problems)
        if not verdict.damaged or (kind == "shardwise" and not index_damaged):
            info.update(_describe(tag_dir, kind))  # reads only the summary and DCP's index
        tags.append(info)
    return {"dir": str(root), "latest": latest, "tags": tags}


def _describe(tag_dir: Path, kind: str | None) -> dict[str, object]:
    """Layout, sizes and contents of one tag, from its summary and index (no tensor data)."""
    info: dict[str, object] = {}
    if kind == "shardwise":
        summary = layout.read_summary(tag_dir)
        for key in (
            "zero_stage",
            "world_size",
            "dp_world_size",
            "mp_world_size",
            "param_dtypes",
            "trainable_parameters",
            "frozen_parameters",
            "fp32_masters_saved",
            "optimizer",
            "saved_at",
        ):
            info[key] = summary.get(key)
        info["global_steps"] = summary.get("counters", {}).get("global_steps")
        entries = StreamingReader(tag_dir).entries
        info["tensors"] = sum(1 for e in entries.values() if e.is_tensor)
        info["optimizer_state_keys"] = sorted(
            {k.rsplit("/", 1)[1] for k in entries if k.startswith(keys.OPTIM) and k != keys.PARAM_GROUPS}
        )
    elif kind == "deepspeed":
        from shardwise.checkpoint.deepspeed_import import DeepSpeedCheckpoint

        info.update(DeepSpeedCheckpoint(tag_dir).describe())
    elif kind == "universal":
        from shardwise.checkpoint.universal_read import UniversalCheckpoint

        info.update(UniversalCheckpoint(tag_dir).describe())
    return info
