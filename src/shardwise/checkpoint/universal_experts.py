"""AutoEP expert files into DeepSpeed's universal layout (``deepspeed.checkpoint.autoep_universal``'s
``consolidate_autoep_expert_files``).

DeepSpeed's universal conversion joins each AutoEP layer's per-expert files
(``layer_{L}_expert_{E}_mp_rank_{MP}_model_states.pt``, row ``E`` of the stacked ``w1``/``w2``/``w3``)
into one ``[num_experts, ...]`` tensor per weight, ``zero/<layer>.experts.w{1,2,3}/fp32.pt``.
shardwise's importer and ``to-universal`` do the same join (:func:`~shardwise.checkpoint.deepspeed_moe.expert_files`
finds the files, :func:`~shardwise.checkpoint.deepspeed_moe.merge_expert_files` stacks them); this module
writes the result as DeepSpeed's function does. Folded AutoEP+AutoTP expert shards (one file per
tensor-parallel rank) are refused by ``expert_files``.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from shardwise.checkpoint import universal_names as names
from shardwise.checkpoint.deepspeed_moe import (
    AUTOEP_WEIGHTS,
    MoELayerRecord,
    expert_files,
    merge_expert_files,
)
from shardwise.checkpoint.folding_metadata import FOLDING_METADATA_KEY

EP_IS_EXPERT_PARAM, EP_NUM_EXPERTS = "is_expert_param", "ep_num_experts"
"""Keys of a universal expert-weight file (DeepSpeed's ``checkpoint.constants`` names)."""


def _records(metadata: object) -> list[MoELayerRecord]:
    """The AutoEP layers of ``ds_autoep_layers`` (``moe_layer_id``, ``num_experts``, ``expert_key_prefix``)."""
    if metadata is None:
        raise RuntimeError("AutoEP metadata is missing from the checkpoint (no ds_autoep_layers): the expert files "
                           "cannot be joined without it; fix: convert a checkpoint saved with AutoEP layers")
    if not isinstance(metadata, list):
        raise RuntimeError(f"AutoEP metadata is malformed: a list of per-layer dicts is expected, got "
                           f"{type(metadata).__name__}")
    out = []
    for entry in metadata:
        missing = [k for k in ("moe_layer_id", "num_experts", "expert_key_prefix") if k not in entry]
        if missing:
            raise RuntimeError(f"AutoEP layer metadata {entry} lacks {missing}")
        prefix = str(entry["expert_key_prefix"])
        if prefix != "experts" and not prefix.endswith(".experts"):
            raise RuntimeError(f"AutoEP expert_key_prefix {prefix!r} does not name a layer's 'experts' module")
        path = str(entry.get("module_path", prefix[: -len("experts")].rstrip(".")))
        out.append(MoELayerRecord(int(entry["moe_layer_id"]), path, "autoep", int(entry["num_experts"]),
                                  int(entry.get("ep_size", 1))))
    return out


def _load(path: str | os.PathLike[str]) -> Any:
    return torch.load(path, map_location="cpu", weights_only=True)


def consolidate_autoep_expert_files(
    checkpoint_dir: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    autoep_layers_metadata: Sequence[Mapping[str, Any]] | None,
    fp32_fallback_param_names: Collection[str] | None = None,
    fp32_fallback_dir: str | os.PathLike[str] | None = None,
) -> None:
    """Join each AutoEP layer's expert files in ``checkpoint_dir`` into ``<output_dir>/zero/<prefix>.w{1,2,3}/fp32.pt``
    (``{"param": [num_experts, ...], "cat_dim": 0, "is_expert_param": True, "ep_num_experts": E}``).

    ``fp32_fallback_param_names`` limits the weights written to those names; with ``fp32_fallback_dir``
    they go to ``<fp32_fallback_dir>/<name>/fp32.pt`` instead (DeepSpeed's ZeRO-1/2 merge reads them there).

    Raises:
        RuntimeError: missing or malformed ``ds_autoep_layers``.
        ValueError: an expert file or one of its rows is missing.
        NotImplementedError: folded AutoEP+AutoTP expert shards, or other multi-model-parallel-rank expert files.
    """
    layers = _records(autoep_layers_metadata)
    paths = expert_files(Path(checkpoint_dir), _load)
    wanted = {(r.layer_id, e) for r in layers for e in range(r.num_experts)}
    files = {where: _load(path) for where, path in paths.items() if where in wanted}
    merged: dict[str, Any] = {}
    merge_expert_files(merged, files, layers)
    for record in layers:
        folding = next((f[FOLDING_METADATA_KEY] for (lay, _), f in sorted(files.items())
                        if lay == record.layer_id and FOLDING_METADATA_KEY in f), None)
        for weight in AUTOEP_WEIGHTS:
            name = f"{record.expert_prefix}{weight}"
            if fp32_fallback_param_names is not None and name not in fp32_fallback_param_names:
                continue
            base = fp32_fallback_dir if fp32_fallback_dir is not None and fp32_fallback_param_names is not None \
                else os.path.join(str(output_dir), names.ZERO_DIR)
            param_dir = os.path.join(str(base), name)
            os.makedirs(param_dir, exist_ok=True)
            state: dict[str, Any] = {names.PARAM: merged[name], names.CAT_DIM: 0, EP_IS_EXPERT_PARAM: True,
                                     EP_NUM_EXPERTS: record.num_experts}
            if folding is not None:
                state[FOLDING_METADATA_KEY] = folding
            torch.save(state, os.path.join(param_dir, f"{names.FP32}.pt"))
