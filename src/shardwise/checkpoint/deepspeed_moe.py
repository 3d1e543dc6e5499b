"""DeepSpeed's file layout of a mixture-of-experts checkpoint: one file per (MoE layer, expert).

A DeepSpeed tag directory of a model with MoE layers holds::

    mp_rank_00_model_states.pt                         every non-expert tensor (gates, routers, shared
                                                       experts included), ``num_experts`` (one count per
                                                       MoE layer) and ``ds_autoep_layers`` (AutoEP layers)
    layer_{L}_expert_{E}_mp_rank_{MP:02d}_model_states.pt   expert ``E`` (global index) of MoE layer ``L``
    expp_rank_{R}_mp_rank_{MP:02d}_optim_states.pt      ZeRO stage 0: ``{"optimizer": ...}`` of the
                                                       ranks of expert-parallel rank ``R``

``L`` counts the model's MoE layers (``deepspeed.moe.layer.MoE`` and AutoEP layers alike) in module
order. An expert file of a ``MoE`` layer holds that layer's state-dict entries under
``deepspeed_moe.experts.deepspeed_experts.<E>.``, named by the global index ``E``; one of an AutoEP
layer holds ``<layer>.experts.w1.<E>`` (and ``w2``, ``w3``): row ``E`` of the stacked weights.

shardwise's own checkpoints name expert tensors by global index too (:mod:`shardwise.moe.naming`;
AutoEP's stacked weights whole), so this module is pure name and tensor arithmetic over whole state
dicts: :func:`split_experts` (a whole module state into the main file's part and the expert files),
:func:`merge_expert_files` (the reverse, for reading DeepSpeed's files), the file names, and
:func:`load_moe_state_dict` (DeepSpeed's ``DeepSpeedEngine.load_moe_state_dict``, which scripts call).

Example:
    >>> expert_ckpt_name("ckpts", 1, 2, "global_step5")
    'ckpts/global_step5/layer_1_expert_2_mp_rank_00_model_states.pt'
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardwise.autoep.layer import AutoEPMoELayer
from shardwise.checkpoint.folding_metadata import FOLDING_METADATA_KEY, validate_runtime_folding
from shardwise.moe.layer import MoE

MOE_EXPERTS = "deepspeed_moe.experts.deepspeed_experts."
MOE_GATE = "deepspeed_moe.gate.wg.weight"
AUTOEP_WEIGHTS = ("w1", "w2", "w3")
AUTOEP_LAYERS_KEY = "ds_autoep_layers"
AUTOEP_REQUIRED_FIELDS = ("moe_layer_id", "module_path", "num_experts", "num_local_experts", "ep_size",
                          "expert_key_prefix")
_EXPERT_FILE = re.compile(r"^layer_(\d+)_expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")


@dataclass(frozen=True)
class MoELayerRecord:
    """One MoE layer as a checkpoint sees it: its module path, kind (``"moe"`` for
    ``deepspeed.moe.layer.MoE``, ``"autoep"`` for an AutoEP layer), expert count and the
    expert-parallel size it was saved with. ``layer_id`` is its place among the MoE layers."""

    layer_id: int
    module_path: str
    kind: str
    num_experts: int
    ep_size: int
    router_alias: str | None = None  # AutoEP: DeepSpeed's second name of the router (its state dict has both)

    @property
    def expert_prefix(self) -> str:
        """The state-dict prefix of the layer's expert tensors."""
        head = f"{self.module_path}." if self.module_path else ""
        return f"{head}{MOE_EXPERTS}" if self.kind == "moe" else f"{head}experts."

    def as_json(self) -> dict[str, Any]:
        """The record for shardwise's checkpoint summary."""
        return {"module_path": self.module_path, "kind": self.kind, "num_experts": self.num_experts,
                "ep_size": self.ep_size, "router_alias": self.router_alias}


def moe_layers(module: nn.Module) -> list[MoELayerRecord]:
    """Every MoE layer of ``module`` (``MoE`` and AutoEP layers), in module order.

    Example:
        >>> moe_layers(nn.Linear(2, 2))
        []
    """
    out: list[MoELayerRecord] = []
    for path, sub in module.named_modules():
        if isinstance(sub, MoE):
            out.append(MoELayerRecord(len(out), path, "moe", sub.num_experts, sub.ep_size))
        elif isinstance(sub, AutoEPMoELayer):
            out.append(MoELayerRecord(len(out), path, "autoep", sub.num_experts, sub.ep_size,
                                      getattr(sub, "checkpoint_router_alias", None)))
    return out


def records_from_json(entries: Sequence[Mapping[str, Any]]) -> list[MoELayerRecord]:
    """The records a shardwise summary keeps (``moe_layers``), numbered in order."""
    return [MoELayerRecord(i, str(e["module_path"]), str(e["kind"]), int(e["num_experts"]), int(e["ep_size"]),
                           e.get("router_alias")) for i, e in enumerate(entries)]


# ---------------------------------------------------------------------- file names
def expert_ckpt_name(checkpoints_path: str | os.PathLike[str], layer_id: int, expert_id: int | str,
                     tag: object, mpu: Any = None, checkpoint_mp_rank: int | None = None) -> str:
    """The file of expert ``expert_id`` of MoE layer ``layer_id`` (DeepSpeed's ``_get_expert_ckpt_name``).

    The model-parallel rank is ``checkpoint_mp_rank``, else ``mpu.get_model_parallel_rank()``, else 0;
    ``layer_id < 0`` names DeepSpeed's older layout, ``expert_{E}_mp_rank_..`` with no layer.
    """
    if checkpoint_mp_rank is None:
        checkpoint_mp_rank = 0 if mpu is None else int(mpu.get_model_parallel_rank())
    directory = os.path.join(str(checkpoints_path), "" if tag is None else str(tag))
    layer = "" if int(layer_id) < 0 else f"layer_{layer_id}_"
    return os.path.join(directory, f"{layer}expert_{expert_id}_mp_rank_{checkpoint_mp_rank:02d}_model_states.pt")


def optim_ckpt_name(checkpoints_path: str | os.PathLike[str], tag: object, expp_rank: int, mp_rank: int = 0) -> str:
    """The stage-0 optimizer file of expert-parallel rank ``expp_rank``."""
    return os.path.join(str(checkpoints_path), str(tag), f"expp_rank_{expp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt")


def expert_files(tag_dir: Path, load: Callable[..., Any] | None = None) -> dict[tuple[int, int], Path]:
    """``{(layer_id, expert_id): path}`` of a tag directory's expert files, whichever model-parallel rank
    wrote each (DeepSpeed's ``resolve_expert_ckpt_path``): the one step every reader of DeepSpeed's expert
    files (the importer, ``to-universal``, ``consolidate_autoep_expert_files``) finds them by.

    Raises:
        NotImplementedError: an expert has files of several model-parallel ranks: the tensor-parallel
            shards of a folded AutoEP+AutoTP run (their files carry the folding record; ``load`` reads
            one to tell) or of a tensor-parallel expert, which are not joined.
    """
    found: dict[tuple[int, int], list[Path]] = {}
    for path in sorted(Path(tag_dir).glob("layer_*_expert_*_model_states.pt")):
        match = _EXPERT_FILE.match(path.name)
        if match:
            found.setdefault((int(match.group(1)), int(match.group(2))), []).append(path)
    for (layer_id, expert), paths in found.items():
        if len(paths) > 1:
            _refuse_tp_expert_shards(layer_id, expert, paths, load or _torch_load)
    return {where: paths[0] for where, paths in found.items()}


def _refuse_tp_expert_shards(layer_id: int, expert: int, paths: Sequence[Path], load: Callable[..., Any]) -> None:
    names = ", ".join(p.name for p in paths)
    if any(isinstance(state := load(p), Mapping) and FOLDING_METADATA_KEY in state
           for p in paths):
        raise NotImplementedError(
            f"Universal checkpoint conversion of folded AutoEP+AutoTP expert shards is not supported: layer "
            f"{layer_id} expert {expert} has one file per tensor-parallel rank ({names}); fix: load the checkpoint "
            "into a folded run of the layout that saved it (same tensor_parallel.autotp_size and "
            "expert_parallel.autoep_size), or save it from a shardwise run and convert that (its experts are whole)"
        )
    raise NotImplementedError(
        f"layer {layer_id} expert {expert} has files of several model-parallel ranks ({names}): tensor-parallel "
        "expert shards are not joined; fix: convert a checkpoint saved without expert tensor parallelism"
    )


# ---------------------------------------------------------------------- whole state <-> files
def _is_moe_expert_key(record: MoELayerRecord, key: str) -> bool:
    head = f"{record.module_path}." if record.module_path else ""
    return key.startswith(head) and "expert" in key[len(head):] and not key.endswith(MOE_GATE)


def split_experts(state: Mapping[str, torch.Tensor], layers: Sequence[MoELayerRecord],
                  first_expert: Mapping[int, int] | None = None,
                  ) -> tuple[dict[str, torch.Tensor], dict[tuple[int, int], dict[str, torch.Tensor]]]:
    """A whole module state (expert tensors by global index, AutoEP's stacked) as DeepSpeed files it:
    ``(main, {(layer_id, expert_id): expert file})``; ``main`` keeps every other entry, in order.

    ``first_expert`` (``layer_id -> global index``) splits one expert-parallel rank's state instead:
    an AutoEP layer's stacked weights then hold that rank's experts from that index on.

    Raises:
        ValueError: an expert tensor of a ``MoE`` layer without a global index, or an AutoEP weight
            whose first dimension is not the layer's expert count.
    """
    main = dict(state)
    files: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    for record in layers:
        prefix = record.expert_prefix
        if record.kind == "moe":
            for key in [k for k in main if _is_moe_expert_key(record, k)]:
                index = key[len(prefix):].partition(".")[0] if key.startswith(prefix) else ""
                if not index.isdigit():
                    raise ValueError(f"{key!r}: an expert tensor of the MoE layer {record.module_path!r} "
                                     f"outside {prefix}<expert index>.; DeepSpeed's expert files cannot hold it")
                files.setdefault((record.layer_id, int(index)), {})[key] = main.pop(key).detach().clone()
            continue
        for weight in AUTOEP_WEIGHTS:
            key = f"{prefix}{weight}"
            stacked = main.pop(key)
            first = 0 if first_expert is None else first_expert[record.layer_id]
            if first_expert is None and stacked.shape[0] != record.num_experts:
                raise ValueError(f"{key!r} has {stacked.shape[0]} experts along dimension 0, the layer "
                                 f"{record.num_experts}: the checkpoint holds only one rank's experts")
            for row in range(stacked.shape[0]):
                expert = first + row
                files.setdefault((record.layer_id, expert), {})[f"{key}.{expert}"] = stacked[row].detach().clone()
    return main, files


def merge_expert_files(main: MutableMapping[str, Any], files: Mapping[tuple[int, int], Mapping[str, Any]],
                       layers: Sequence[MoELayerRecord]) -> None:
    """Put the expert files' tensors back into ``main`` under shardwise's names: a ``MoE`` layer's
    entries as they are (already global), an AutoEP layer's rows stacked into ``<layer>.experts.w{1,2,3}``.

    Raises:
        ValueError: an expert file of the layers is missing or lacks a weight.
    """
    for record in layers:
        expected = [(record.layer_id, e) for e in range(record.num_experts)]
        missing = [f"layer_{lay}_expert_{e}" for lay, e in expected if (lay, e) not in files]
        if missing:
            raise ValueError(f"the MoE layer {record.module_path!r} (layer {record.layer_id}, {record.num_experts} "
                             f"experts) has no expert file {', '.join(missing)}")
        if record.kind == "moe":
            for where in expected:
                main.update(files[where])
            continue
        for weight in AUTOEP_WEIGHTS:
            key = f"{record.expert_prefix}{weight}"
            rows = []
            for layer_id, expert in expected:
                row = files[(layer_id, expert)].get(f"{key}.{expert}")
                if row is None:
                    raise ValueError(f"the expert file layer_{layer_id}_expert_{expert} has no {key}.{expert}")
                rows.append(row)
            main[key] = torch.stack(rows)


def add_router_aliases(main: dict[str, torch.Tensor], layers: Sequence[MoELayerRecord]) -> None:
    """Copy each AutoEP layer's router entries under DeepSpeed's second name of its router
    (``<layer>.<alias>.<rest>``; ``router_alias``), as DeepSpeed's state dict holds them."""
    for record in layers:
        if record.kind == "autoep" and record.router_alias:
            head = f"{record.module_path}." if record.module_path else ""
            for key in [k for k in main if k.startswith(f"{head}router.")]:
                main.setdefault(f"{head}{record.router_alias}.{key[len(head) + len('router.'):]}", main[key])


def drop_router_aliases(main: dict[str, Any], layers: Sequence[MoELayerRecord]) -> None:
    """Remove DeepSpeed's second copies of AutoEP routers: ``<layer>.<name>.<rest>`` equal to
    ``<layer>.router.<rest>`` (shardwise's layer registers its router once)."""
    for record in layers:
        if record.kind != "autoep":
            continue
        head = f"{record.module_path}." if record.module_path else ""
        routers = {k[len(head) + len("router."):]: v for k, v in main.items() if k.startswith(f"{head}router.")}
        for key in list(main):
            name, _, rest = key[len(head):].partition(".") if key.startswith(head) else ("router", "", "")
            if name not in ("router", "experts") and rest in routers and torch.equal(main[key], routers[rest]):
                del main[key]


def layers_from_deepspeed(model_states: Mapping[str, Any], files: Mapping[tuple[int, int], Mapping[str, Any]]
                          ) -> list[MoELayerRecord]:
    """The MoE layers of a DeepSpeed checkpoint, from its main file's ``num_experts`` and
    ``ds_autoep_layers`` and the names inside its expert files."""
    counts = model_states.get("num_experts")
    if not isinstance(counts, list) or not files:
        return []
    autoep = {int(e["moe_layer_id"]): e for e in (model_states.get(AUTOEP_LAYERS_KEY) or [])}
    out = []
    for layer_id, count in enumerate(counts):
        if layer_id in autoep:
            entry = autoep[layer_id]
            out.append(MoELayerRecord(layer_id, str(entry["module_path"]), "autoep", int(entry["num_experts"]),
                                      int(entry["ep_size"])))
            continue
        sample = files.get((layer_id, 0)) or {}
        key = next((k for k in sample if MOE_EXPERTS in k), None)
        if key is None:
            raise ValueError(f"the expert file layer_{layer_id}_expert_0 names no {MOE_EXPERTS}<E> tensor")
        path = key.split(MOE_EXPERTS)[0].rstrip(".")
        out.append(MoELayerRecord(layer_id, path, "moe", int(count), 1))
    return out


# ---------------------------------------------------------------------- AutoEP metadata
def autoep_metadata(layers: Sequence[MoELayerRecord], ep_size: int | None = None,
                    ep_rank: int = 0) -> list[dict[str, Any]] | None:
    """``ds_autoep_layers`` of the AutoEP layers as expert-parallel rank ``ep_rank`` of ``ep_size``
    (default: each layer's own) writes it (None without AutoEP layers, as DeepSpeed writes)."""
    out = []
    for record in layers:
        if record.kind != "autoep":
            continue
        ep_size = ep_size or record.ep_size
        local = record.num_experts // ep_size
        out.append({
            "moe_layer_id": record.layer_id, "module_path": record.module_path, "num_experts": record.num_experts,
            "num_local_experts": local, "ep_size": ep_size, "expert_key_prefix": record.expert_prefix.rstrip("."),
            "ep_group_name": f"ep_size_{ep_size}", "ep_rank": ep_rank, "expert_data_parallel_rank": 0,
            "global_expert_start": ep_rank * local, "global_expert_end": (ep_rank + 1) * local,
            "autoep_zero3_expert_state_format": "per_expert_files",
        })
    return out or None


def check_autoep_metadata(entries: object) -> list[dict[str, Any]]:
    """``ds_autoep_layers`` checked: a list of dicts with DeepSpeed's required fields, layer ids and
    expert prefixes unique, ``num_experts == num_local_experts * ep_size``.

    Raises:
        RuntimeError: naming what is malformed or which fields are missing.
    """
    if not isinstance(entries, list):
        raise RuntimeError(f"ds_autoep_layers metadata is malformed: a list of per-layer dicts is expected, "
                           f"got {type(entries).__name__}")
    seen_ids: set[object] = set()
    seen_prefixes: set[object] = set()
    for entry in entries:
        if not isinstance(entry, dict):
            raise RuntimeError(f"ds_autoep_layers entry is malformed: a dict is expected, got {type(entry).__name__}")
        missing = sorted(set(AUTOEP_REQUIRED_FIELDS) - entry.keys())
        if missing:
            raise RuntimeError(f"ds_autoep_layers entry {entry} is invalid: missing fields {missing}")
        if entry["moe_layer_id"] in seen_ids or entry["expert_key_prefix"] in seen_prefixes:
            raise RuntimeError(f"ds_autoep_layers repeats moe_layer_id {entry['moe_layer_id']} or expert_key_prefix "
                               f"{entry['expert_key_prefix']!r}")
        seen_ids.add(entry["moe_layer_id"])
        seen_prefixes.add(entry["expert_key_prefix"])
        if entry["num_local_experts"] * entry["ep_size"] != entry["num_experts"]:
            raise RuntimeError(f"ds_autoep_layers entry of {entry['module_path']!r} is inconsistent: num_local_experts "
                               f"{entry['num_local_experts']} x ep_size {entry['ep_size']} != num_experts "
                               f"{entry['num_experts']}")
    return entries


# ---------------------------------------------------------------------- DeepSpeed's static loader
def _torch_load(path: str | os.PathLike[str], map_location: Any = None) -> Any:
    return torch.load(path, map_location="cpu", weights_only=True)  # an expert file holds tensors only


def load_moe_state_dict(checkpoint_path: str | os.PathLike[str], tag: object, state_dict: MutableMapping[str, Any],
                        old_moe_load: bool, model: nn.Module | None = None, mpu: Any = None,
                        num_experts: int | Sequence[int] = 1, checkpoint_engine: Any = None,
                        autoep_layers: object = None, folding_spec: object = None,
                        checkpoint_mp_rank: int | None = None) -> None:
    """Add this rank's experts, read from DeepSpeed's expert files, to ``state_dict`` under the
    model's local names (DeepSpeed's ``DeepSpeedEngine.load_moe_state_dict``).

    ``old_moe_load`` reads DeepSpeed's older ``expert_<E>_...`` files (no layer index; every layer's
    copy of expert ``E`` in one file). ``autoep_layers`` (a checkpoint's ``ds_autoep_layers``) is
    checked first. With ``folding_spec`` (a folded AutoEP+AutoTP layout,
    :class:`~shardwise.autoep.folding.ParallelFoldingSpec`) each expert file's folding record is checked
    against it (``checkpoint_mp_rank`` the TP rank); without, a file with a record is refused. ``checkpoint_engine`` is anything with ``load(path, map_location=...)``.

    Raises:
        RuntimeError: malformed ``autoep_layers``, ``old_moe_load`` with AutoEP layers, or a folding
            record missing, unexpected or of another layout.
        FileNotFoundError: an expert file is missing.
    """
    if checkpoint_mp_rank is None:
        checkpoint_mp_rank = 0 if mpu is None else int(mpu.get_model_parallel_rank())
    folded = folding_spec is not None and int(getattr(folding_spec, "tp_size", 1)) > 1

    def checked(saved: Mapping[str, Any], path: str, ep_rank: int) -> dict[str, Any]:
        """An expert file's tensors, its folding record checked against ``folding_spec`` (then dropped)."""
        validate_runtime_folding(
            saved, folding_spec=folding_spec if folded else None, family="routed_expert",  # type: ignore[arg-type]
            zero_partition_group="edp", zero_partition_count=getattr(folding_spec, "edp_size", None) if folded else None,
            tp_rank=checkpoint_mp_rank if folded else None, ep_rank=ep_rank if folded else None, where=path)
        return {k: v for k, v in saved.items() if k != FOLDING_METADATA_KEY}

    load: Callable[..., Any] = checkpoint_engine.load if checkpoint_engine is not None else _torch_load
    layers = [] if model is None else moe_layers(model)
    if autoep_layers is not None:
        check_autoep_metadata(autoep_layers)
    if old_moe_load:
        if any(r.kind == "autoep" for r in layers):
            raise RuntimeError("load_moe_state_dict(old_moe_load=True): DeepSpeed's older expert files predate "
                               "AutoEP layers; fix: convert the checkpoint to the universal layout first")
        counts = [num_experts] if isinstance(num_experts, int) else list(num_experts)
        first = next((m for m in model.modules() if isinstance(m, MoE)), None) if model is not None else None
        ep_size = first.ep_size if first is not None else 1
        ep_rank = first.deepspeed_moe.ep_rank if first is not None else 0
        local_count = max(counts) // ep_size
        for local in range(local_count):
            _rename_into(state_dict, load(expert_ckpt_name(checkpoint_path, -1, ep_rank * local_count + local, tag,
                                                           checkpoint_mp_rank=checkpoint_mp_rank),
                                          map_location="cpu"), ep_rank * local_count + local, local)
        return
    assert model is not None or not layers
    modules = dict(model.named_modules()) if model is not None else {}
    for record in layers:
        layer = modules[record.module_path]
        ep_rank = layer.deepspeed_moe.ep_rank if record.kind == "moe" else layer.ep_rank
        local_count = record.num_experts // record.ep_size
        rows: dict[str, list[torch.Tensor]] = {w: [] for w in AUTOEP_WEIGHTS}
        for local in range(local_count):
            expert = ep_rank * local_count + local
            path = expert_ckpt_name(checkpoint_path, record.layer_id, expert, tag, checkpoint_mp_rank=checkpoint_mp_rank)
            if not os.path.exists(path):
                raise FileNotFoundError(f"expert file {path} is missing (layer {record.layer_id} "
                                        f"{record.module_path!r}, expert {expert})")
            saved = checked(load(path, map_location="cpu"), path, int(ep_rank))
            if record.kind == "moe":
                _rename_into(state_dict, saved, expert, local)
                continue
            for weight in AUTOEP_WEIGHTS:
                key = f"{record.expert_prefix}{weight}.{expert}"
                if key not in saved:
                    raise RuntimeError(f"expert file {path} has no {key!r}")
                rows[weight].append(saved[key])
        if record.kind == "autoep":
            for weight in AUTOEP_WEIGHTS:
                state_dict[f"{record.expert_prefix}{weight}"] = torch.stack(rows[weight])


def _rename_into(state_dict: MutableMapping[str, Any], saved: Mapping[str, Any], expert: int, local: int) -> None:
    """``saved``'s entries with global expert index ``expert`` renamed to local index ``local``."""
    pattern = re.compile(rf"(^|\.){re.escape(MOE_EXPERTS)}{expert}\.")
    for key, value in saved.items():
        state_dict[pattern.sub(rf"\g<1>{MOE_EXPERTS}{local}.", key, count=1)] = value
