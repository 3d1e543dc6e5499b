"""Read checkpoints written by DeepSpeed (stages 0-3; layout in the spec, section 8) to migrate mid-run.

DeepSpeed writes ``torch.save`` pickles that name a few of its own classes (the ZeRO stage
enum, ``fragment_address``, loss scalers). They are read here with ``weights_only=True``
and a small stand-in class per DeepSpeed name, so neither DeepSpeed nor arbitrary pickle
code is needed, and memory-mapped, so only the pages used are read.

What is reconstructed, as full tensors by parameter name (the keys of
``OptimizerState.full_state_dict``):

* stages 1-2 (and the bf16 optimizer): each rank's fp32 partition and flat optimizer state,
  cut by ``param_slice_mappings`` (name -> fragment of this rank's partition) and
  concatenated over ranks; without those mappings, by ``param_shapes`` order;
* stage 3: every parameter is split on its own into ``ceil(numel / world)`` elements per rank;
  frozen parameters likewise from ``frozen_param_fragments``;
* stage 0: the module weights and the torch optimizer's per-parameter state (fp32).

The files themselves are read by :mod:`~shardwise.checkpoint.deepspeed_files` and stage 0's
optimizer state by :mod:`~shardwise.checkpoint.deepspeed_stage0_import`; ``ForeignObject`` and
``load_file`` stay importable from here.

Example:
    >>> # engine.load_checkpoint("deepspeed_ckpts")   # detected and imported automatically
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from shardwise.checkpoint import keys
from shardwise.checkpoint.deepspeed_files import ForeignObject, _fragment, _plain, _rank_of, load_file
from shardwise.checkpoint.deepspeed_moe_import import DeepSpeedMoEFiles, local_expert_state
from shardwise.checkpoint.deepspeed_stage0_import import stage0_optimizer
from shardwise.checkpoint.module_state import copy_whole_state
from shardwise.checkpoint.training_state import LoadResult, TrainingState, param_names, restore_parts
from shardwise.utils.logging import logger


def _elementwise_keys(state: Mapping[str, object], numel: int) -> list[str]:
    return [k for k, v in state.items() if k != "step" and torch.is_tensor(v) and v.numel() == numel]


class DeepSpeedCheckpoint:
    """One DeepSpeed tag directory, readable by parameter name."""

    def __init__(self, tag_dir: Path) -> None:
        self.tag_dir = Path(tag_dir)
        model_files = sorted(self.tag_dir.glob("*model_states.pt"))
        if not model_files:
            raise FileNotFoundError(f"{tag_dir} has no DeepSpeed *_model_states.pt file")
        stage3_files = sorted(self.tag_dir.glob("zero_pp_rank_*_mp_rank_00_model_states.pt"), key=_rank_of)
        self.model_file = stage3_files[0] if stage3_files else self.tag_dir / "mp_rank_00_model_states.pt"
        if not self.model_file.is_file():
            raise FileNotFoundError(f"{tag_dir}: expected mp_rank_00_model_states.pt (model-parallel rank 0)")
        self.model = load_file(self.model_file)
        self.moe = DeepSpeedMoEFiles.open(self.tag_dir, self.model, load_file)
        if self.moe is not None:  # experts in their own files: one whole module state from here on
            self.model = {**self.model, "module": self.moe.merged_module(self.model["module"])}
        if int(self.model.get("mp_world_size", 1) or 1) > 1:
            raise ValueError(
                f"{tag_dir} is a tensor-parallel DeepSpeed checkpoint; only mp size 1 is imported"
            )
        optim_files = [
            f
            for f in self.tag_dir.glob("*zero_pp_rank_*_mp_rank_00_optim_states.pt")
            if not f.name.startswith("exp")
        ]
        self.optim_files = sorted(optim_files, key=_rank_of)
        self._optim: list[Any] | None = None
        config_stage = (self.model.get("ds_config") or {}).get("zero_optimization", {}).get("stage", 0)
        self.stage = 3 if stage3_files else (int(_plain(config_stage)) if self.optim_files else 0)
        self.world_size = int(self.model.get("dp_world_size", len(self.optim_files) or 1))
        self.buffer_names = list(self.model.get("buffer_names") or [])
        self._params: dict[str, torch.Tensor] | None = None

    # ------------------------------------------------------------------ files
    def optim_states(self) -> list[dict[str, Any]]:
        """Every rank's ``optimizer_state_dict``, in rank order (memory-mapped)."""
        if self._optim is None:
            self._optim = [load_file(f)["optimizer_state_dict"] for f in self.optim_files]
        return self._optim

    def saved_loss_scaler(self) -> Any:
        """DeepSpeed's saved loss scaler (a stand-in object), or None (stage 0: none saved)."""
        return self.optim_states()[0].get("loss_scaler") if self.optim_files else None

    def counters(self) -> dict[str, int]:
        """``global_steps``, ``skipped_steps`` and (when saved) ``global_samples``."""
        out = {
            "global_steps": int(self.model.get("global_steps", 0)),
            "skipped_steps": int(self.model.get("skipped_steps", 0)),
        }
        if self.model.get("global_samples") is not None:
            out["global_samples"] = int(self.model["global_samples"])
        return out

    def describe(self) -> dict[str, Any]:
        """A short summary for ``shardwise checkpoint info``."""
        return {
            "zero_stage": self.stage,
            "world_size": self.world_size,
            "global_steps": self.model.get("global_steps"),
            "ds_version": self.model.get("ds_version"),
            "files": len(list(self.tag_dir.glob("*.pt"))),
        }

    # ------------------------------------------------------------------ parameter layout
    def _param_shapes(self) -> list[dict[str, tuple[int, ...]]]:
        groups = self.model.get("param_shapes") or []
        if isinstance(groups, dict):
            groups = [groups]
        return [{name: tuple(shape) for name, shape in group.items()} for group in groups]

    def _flat_groups(self, field: str) -> list[list[torch.Tensor]]:
        """Per rank, per group: a flat fp32 tensor (``field``) or the inner optimizer's state."""
        return [list(state[field]) for state in self.optim_states()]

    def _assemble(
        self, per_rank: Sequence[Sequence[torch.Tensor]], group: int, shapes: Mapping[str, Any]
    ) -> dict[str, torch.Tensor]:
        """Cut per-rank flat tensors of one group into full parameters (an expert group's under
        global names, from its expert-parallel ranks' partitions)."""
        out: dict[str, torch.Tensor] = {}
        counts = self.optim_states()[0].get("partition_count") if self.optim_files else None
        if self.moe is not None and self.stage in (1, 2) and self._is_expert_group(group) and counts:
            slices = [state.get("param_slice_mappings") for state in self.optim_states()]
            return self.moe.assemble_expert_group(per_rank, group, shapes, slices, int(counts[group]), _fragment)
        if self.stage == 3:
            offsets = [0] * len(per_rank)
            for name, shape in shapes.items():
                numel = math.prod(shape)
                part = math.ceil(numel / self.world_size)
                pieces = [flat[group][offsets[r] : offsets[r] + part] for r, flat in enumerate(per_rank)]
                offsets = [o + part for o in offsets]
                out[name] = torch.cat(pieces)[:numel].view(shape)
            return out
        mappings: list[Any] = [state.get("param_slice_mappings") for state in self.optim_states()]
        if all(m is not None for m in mappings):
            fragments: dict[str, list[torch.Tensor]] = {name: [] for name in shapes}
            for r, flat in enumerate(per_rank):
                for name, address in mappings[r][group].items():
                    start, numel = _fragment(address)
                    fragments.setdefault(name, []).append(flat[group][start : start + numel])
            for name, shape in shapes.items():
                out[name] = torch.cat(fragments[name]).view(shape)
            return out
        whole = torch.cat([flat[group] for flat in per_rank])  # no mappings: params back to back
        offset = 0
        for name, shape in shapes.items():
            numel = math.prod(shape)
            out[name] = whole[offset : offset + numel].view(shape)
            offset += numel
        return out

    def fp32_params(self) -> dict[str, torch.Tensor]:
        """Full fp32 master weights of the trainable parameters ({} when not saved separately)."""
        if self._params is not None:
            return self._params
        out: dict[str, torch.Tensor] = {}
        if self.stage >= 1 and self.optim_states():
            field = "fp32_flat_groups" if self.stage == 3 else "single_partition_of_fp32_groups"
            per_rank = self._flat_groups(field)
            for g, shapes in enumerate(self._param_shapes()):
                out.update(self._assemble(per_rank, g, shapes))
        self._params = out
        return out

    def _stage3_frozen(self, name: str) -> torch.Tensor:
        shape = tuple(self.model["frozen_param_shapes"][name])
        files = sorted(self.tag_dir.glob("zero_pp_rank_*_mp_rank_00_model_states.pt"), key=_rank_of)
        pieces = [load_file(f)["frozen_param_fragments"][name].reshape(-1) for f in files]
        return torch.cat(pieces)[: math.prod(shape)].view(shape)

    # ------------------------------------------------------------------ module tensors
    def module_specs(self, *, exclude_frozen: bool = False) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """``name -> (shape, dtype)`` of the module's state dict, in its order."""
        frozen = dict(self.model.get("frozen_param_shapes") or {})
        trainable = {n: s for group in self._param_shapes() for n, s in group.items()}
        specs = {}
        for name, tensor in self.model["module"].items():
            if exclude_frozen and name in frozen:
                continue
            shape = tuple(tensor.shape)
            if self.stage == 3 and name not in self.buffer_names:
                shape = tuple(trainable.get(name) or frozen.get(name) or shape)
            specs[name] = (shape, tensor.dtype)
        return specs

    def best_dtype(self, name: str) -> torch.dtype:
        """fp32 where a master exists, else the saved dtype."""
        return torch.float32 if name in self.fp32_params() else self.model["module"][name].dtype

    def read_module_tensor(self, name: str) -> torch.Tensor:
        """A full module tensor: the fp32 master for trainable parameters when saved."""
        masters = self.fp32_params()
        if name in masters:
            return masters[name]
        if self.stage == 3 and name in (self.model.get("frozen_param_shapes") or {}):
            return self._stage3_frozen(name)
        return self.model["module"][name]

    def module_state_dict(self) -> dict[str, torch.Tensor]:
        """Every module entry, full size, in the module's dtype."""
        return {
            name: self.read_module_tensor(name).to(dtype) for name, (_, dtype) in self.module_specs().items()
        }

    # ------------------------------------------------------------------ optimizer state
    def optimizer_state(self, trainable_names: Sequence[str]) -> dict[str, Any] | None:
        """Masters, optimizer state and param groups in ``full_state_dict`` form, or None if absent."""
        if self.stage == 0:
            return stage0_optimizer(self, trainable_names)
        inner_field = "optimizer_state_dict" if self.stage == 3 else "base_optimizer_state"
        inners = [state[inner_field] for state in self.optim_states()]
        out: dict[str, Any] = {f"master/{n}": t for n, t in self.fp32_params().items()}
        groups: list[dict[str, Any]] = []
        for g, shapes in enumerate(self._param_shapes()):
            state0 = inners[0]["state"].get(g, {})
            flat_numel = self._flat_groups(
                "fp32_flat_groups" if self.stage == 3 else "single_partition_of_fp32_groups"
            )[0][g].numel()
            elementwise = _elementwise_keys(state0, flat_numel)
            for key in elementwise:
                per_rank = [
                    [inner["state"][gg].get(key) for gg in sorted(inner["state"])] for inner in inners
                ]
                for name, tensor in self._assemble(per_rank, g, shapes).items():
                    out[f"optim/{name}/{key}"] = tensor
            names = list(shapes)
            if self.moe is not None and self._is_expert_group(g):  # every expert-parallel rank's experts
                ep_size = len(self.moe.expert_group_ranks(self.world_size, int(self.optim_states()[0]["partition_count"][g])))
                names = [self.moe.global_name(n, r, ep_size) for r in range(ep_size) for n in shapes]
            for key, value in state0.items():
                if key in elementwise:
                    continue
                whole = self._whole_param_state(inners, g, key) if torch.is_tensor(value) else None
                for name in names:
                    out[f"optim/{name}/{key}"] = value if whole is None else whole[name]
            dropped = ("params", "name", "moe") if self.moe is not None else ("params",)
            hyper = {k: v for k, v in inners[0]["param_groups"][g].items() if k not in dropped}
            home = next((h for h in groups if {k: v for k, v in h.items() if k != keys.PARAM_NAMES} == hyper), None)
            if self.moe is not None and home is not None:  # DeepSpeed's expert group joins its client group
                home[keys.PARAM_NAMES] += names
            else:
                groups.append({**hyper, keys.PARAM_NAMES: names})
        out[keys.PARAM_GROUPS] = groups
        return out

    def _is_expert_group(self, group: int) -> bool:
        """Whether DeepSpeed marked optimizer group ``group`` as an expert group (``"moe": True``)."""
        inner = self.optim_states()[0].get("base_optimizer_state") if self.optim_files else None
        groups = inner.get("param_groups", []) if isinstance(inner, dict) else []
        return group < len(groups) and bool(groups[group].get("moe"))

    def _whole_param_state(self, inners: list[Any], group: int, key: str) -> dict[str, torch.Tensor] | None:
        """DeepSpeed's ZeRO-1/2 Muon momentum: per rank, the whole parameters its partition touches.

        Muon orthogonalises whole matrices, so DeepSpeed keeps each rank's ``momentum_buffer`` as
        the concatenation of every parameter that overlaps the rank's partition (in the rank's
        ``param_slice_mappings`` order), not as a flat partition like Adam's moments; a parameter
        split across two ranks is held whole by both. None when ``key`` is not laid out so.
        """
        mappings: list[Any] = [state.get("param_slice_mappings") for state in self.optim_states()]
        shapes = self._param_shapes()[group]
        if any(m is None for m in mappings):
            return None
        out: dict[str, torch.Tensor] = {}
        for inner, mapping in zip(inners, mappings):
            tensor = inner["state"].get(group, {}).get(key)
            names = list(mapping[group])
            if not torch.is_tensor(tensor) or tensor.numel() != sum(math.prod(shapes[n]) for n in names):
                return None
            offset = 0
            for name in names:
                numel = math.prod(shapes[name])
                out.setdefault(name, tensor.reshape(-1)[offset : offset + numel].view(shapes[name]).clone())
                offset += numel
        return out if set(out) == set(shapes) else None


def read_deepspeed_checkpoint(path: str | Path, tag: str | None = None) -> DeepSpeedCheckpoint:
    """Open a DeepSpeed checkpoint (a save directory with ``latest``, or a tag directory).

    Example:
        >>> # ckpt = read_deepspeed_checkpoint("ds_ckpts"); ckpt.module_state_dict()
    """
    from shardwise.checkpoint import layout

    return DeepSpeedCheckpoint(layout.resolve(path, tag))


_CLIENT_EXCLUDED = (
    "module",
    "skipped_steps",
    "global_steps",
    "dp_world_size",
    "mp_world_size",
    "data_sampler",
    "random_ltd",
)


def load_deepspeed_checkpoint(
    state: TrainingState,
    path: Path,
    *,
    load_module_strict: bool,
    load_optimizer_states: bool,
    load_lr_scheduler_states: bool,
    load_module_only: bool,
    ckpt: Any = None,
) -> LoadResult:
    """Load a DeepSpeed tag directory into a :class:`~shardwise.checkpoint.training_state.TrainingState`.

    ``ckpt`` is the opened checkpoint (default: :class:`DeepSpeedCheckpoint` of ``path``); a
    :class:`~shardwise.checkpoint.universal_read.UniversalCheckpoint` reads the same way.
    """
    ckpt = DeepSpeedCheckpoint(path) if ckpt is None else ckpt
    logger.info(
        "importing DeepSpeed %s %s checkpoint %s (ZeRO stage %d, %d ranks)",
        ckpt.model.get("ds_version"),
        "native" if isinstance(ckpt, DeepSpeedCheckpoint) else "universal",
        path,
        ckpt.stage,
        ckpt.world_size,
    )
    copy_whole_state(
        state.module,
        local_expert_state(state.module, ckpt.module_state_dict()),
        strict=load_module_strict,
        source=f"the DeepSpeed checkpoint {path}",
        fix="Load with load_module_strict=False to load the matching entries only.",
    )
    names = param_names(state.module)
    optimizer = state.optimizer
    if optimizer is not None and not load_module_only:
        trainable = [n for n, p in state.module.named_parameters() if p.requires_grad]
        full = ckpt.optimizer_state(trainable)
        if full is not None:
            if not load_optimizer_states:
                full = {k: v for k, v in full.items() if k.startswith(keys.MASTER)}
            optimizer.load_full_state_dict(full, names, with_state=load_optimizer_states)
        else:
            optimizer.refresh_masters_from_params()
    elif optimizer is not None:
        optimizer.refresh_masters_from_params()
    counters: dict[str, int] = {}
    if not load_module_only:
        counters = ckpt.counters()
        counters["micro_steps"] = counters["global_steps"] * max(1, state.gradient_accumulation_steps)
        scaler = state.parts.get("loss_scaler")
        saved = {
            "counters": counters,
            "lr_scheduler": ckpt.model.get("lr_scheduler"),
            "loss_scaler": (
                _imported_loss_scaler(scaler.stateful, ckpt.saved_loss_scaler())
                if scaler is not None and load_optimizer_states
                else None
            ),
        }
        restore_parts(
            state.parts,
            saved,
            None,
            with_optimizer=load_optimizer_states,
            with_scheduler=load_lr_scheduler_states,
        )
    excluded = set(_CLIENT_EXCLUDED)
    if load_optimizer_states and not load_module_only:
        excluded.add("optimizer")
    if load_lr_scheduler_states and not load_module_only:
        excluded.add("lr_scheduler")
    client_state = {k: v for k, v in ckpt.model.items() if k not in excluded}
    return LoadResult(ckpt.model_file, client_state, counters)


def _imported_loss_scaler(scaler: Any, saved: Any) -> dict[str, Any] | None:
    """This run's scaler state with DeepSpeed's fp16 scale and counters carried over, when both
    sides use the same kind of scaling; None (the scaler keeps its state) otherwise."""
    if isinstance(saved, dict):  # shardwise's own state dict (a universal checkpoint it wrote)
        return saved if saved.get("kind") == getattr(scaler, "kind", None) else None
    if not isinstance(saved, ForeignObject) or not isinstance(saved.state, dict):
        return None
    values = saved.state
    if (
        bool(values.get("dynamic", False)) != bool(getattr(scaler, "dynamic", False))
        or "cur_scale" not in values
    ):
        return None
    mine: dict[str, Any] = dict(scaler.state_dict())
    mine.update(
        {
            "cur_scale": float(values["cur_scale"]),
            "cur_iter": int(values.get("cur_iter", mine["cur_iter"])),
            "last_overflow_iter": int(values.get("last_overflow_iter", mine["last_overflow_iter"])),
            "cur_hysteresis": int(values.get("cur_hysteresis", mine["cur_hysteresis"])),
        }
    )
    return mine
