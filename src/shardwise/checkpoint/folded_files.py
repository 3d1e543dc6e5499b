"""Checkpoints of a folded AutoEP + AutoTP run: DeepSpeed's files with the layout record, and the check on load.

A folded run (:mod:`shardwise.autoep.folding`: expert groups of ``ep`` consecutive ranks across the
``tp`` lanes) saves what every shardwise save does (DCP, whole tensors) and, with
``checkpoint.deepspeed_moe_files`` (default true), DeepSpeed 0.19.8's files of such a run, each with
the ``"folding"`` record of :mod:`~shardwise.checkpoint.folding_metadata`:

* ``mp_rank_{T}_model_states.pt`` (the first data-parallel rank of TP lane ``T``): the lane's
  non-expert tensors, family ``dense``, ZeRO group ``dense_dp``, and each entry's family;
* ``layer_{L}_expert_{E}_mp_rank_{T}_model_states.pt`` (the first rank holding tensor-parallel rank
  ``T`` and expert-parallel rank ``R``): ``R``'s experts, family ``routed_expert``, group ``edp``;
* at ZeRO stage 0, ``expp_rank_{R}_mp_rank_{T}_optim_states.pt`` (the same rank): ``{"optimizer": the
  rank's torch optimizer state_dict}`` with the ``routed_expert`` record. (At stages 1-2 the optimizer
  state is in shardwise's DCP files only, as for every MoE save.)

shardwise's summary records the layout too (``summary["folding"]``: rank 0's model-file record).
A folded run's load checks, before anything else is read, the summary and this rank's DeepSpeed
files against its own layout (:func:`check_before_load`) and refuses a checkpoint without the record
or of another layout, naming the axis. (shardwise's DCP tensors are whole, so an unfolded run loads
a folded checkpoint's weights; DeepSpeed's files of it are refused there by DeepSpeed's rule.)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardwise.autoep.folding import ParallelFoldingSpec, build_folding_spec
from shardwise.checkpoint import deepspeed_files, layout
from shardwise.checkpoint import folding_metadata as fm
from shardwise.checkpoint.deepspeed_moe import MoELayerRecord, expert_ckpt_name, optim_ckpt_name
from shardwise.comm.fsdp_internals import local_tensor
from shardwise.comm.topology import Topology


@dataclass(frozen=True)
class FoldedRun:
    """This rank's place in a folded layout: the sizes, its ranks, and which files it writes."""

    spec: ParallelFoldingSpec
    tp_rank: int
    ep_rank: int
    dp_rank: int  # dense data parallelism: the ranks ``tp`` apart
    edp_rank: int  # expert data parallelism: the ranks ``ep`` apart
    expert_writer: bool  # the first rank with its (tp_rank, ep_rank): writes those experts' files

    @property
    def model_writer(self) -> bool:
        """Whether this rank writes its TP lane's model file (the lane's first data-parallel rank)."""
        return self.dp_rank == 0

    def model_file(self) -> str:
        """This rank's TP lane's DeepSpeed model file."""
        return f"mp_rank_{self.tp_rank:02d}_model_states.pt"

    def record(self, family: str, **extra: Any) -> dict[str, Any]:
        """The record of a file this rank writes: ``dense`` (model file) or ``routed_expert``."""
        dense = family == "dense"
        return fm.make_folding_metadata(
            tp_size=self.spec.tp_size, tp_rank=self.tp_rank, ep_size=self.spec.ep_size, ep_rank=self.ep_rank,
            zero_partition_group="dense_dp" if dense else "edp",
            zero_partition_rank=self.dp_rank if dense else self.edp_rank,
            zero_partition_count=self.spec.dp_size if dense else self.spec.edp_size, family=family, **extra,
        )


def folded_run(topology: Topology) -> FoldedRun | None:
    """This rank's :class:`FoldedRun`, or None when experts are not folded over ``tp`` > 1."""
    dims = topology.dims
    if not dims.fold_ep or dims.tp <= 1:
        return None
    spec = build_folding_spec(world_size=dims.world_size, pp_size=dims.pp, tp_size=dims.tp, ep_size=dims.ep)
    place = {dim: {r: g.index(r) for g in dims.rank_groups(dim) for r in g} for dim in ("tp", "ep")}
    me = topology.world_rank
    pair = (place["tp"][me], place["ep"][me])
    first = min(r for r in range(dims.world_size) if (place["tp"][r], place["ep"][r]) == pair)
    return FoldedRun(spec, pair[0], pair[1], topology.rank_in("dp"), topology.rank_in("edp"), first == me)


# ---------------------------------------------------------------------- save
def side_files(run: FoldedRun, module: nn.Module, layers: list[MoELayerRecord], main: dict[str, torch.Tensor],
               experts: Mapping[tuple[int, int], dict[str, torch.Tensor]], main_file: dict[str, Any] | None,
               optimizer: Any, zero_stage: int) -> dict[str, dict[str, Any]]:
    """This rank's DeepSpeed files of a folded save (names in the module docstring), each with its record.

    ``main``/``experts`` are this rank's non-expert entries and expert files
    (:func:`~shardwise.checkpoint.deepspeed_moe.split_experts`); ``main_file`` the model-file dict
    (rank-independent entries) when this rank writes one; ``optimizer`` the torch optimizer (stage 0).
    """
    out: dict[str, dict[str, Any]] = {}
    if run.expert_writer:
        for (layer_id, expert), tensors in experts.items():
            name = expert_ckpt_name("", layer_id, expert, None, checkpoint_mp_rank=run.tp_rank)
            out[name] = {**tensors, fm.FOLDING_METADATA_KEY: run.record("routed_expert")}
        if zero_stage == 0 and optimizer is not None:
            state = _cpu(optimizer.state_dict())
            out[Path(optim_ckpt_name("", "", run.ep_rank, run.tp_rank)).name] = {
                "optimizer": state, fm.FOLDING_METADATA_KEY: run.record("routed_expert")}
    if run.model_writer and main_file is not None:
        families = fm.param_families(main, [r.module_path for r in layers])
        out[run.model_file()] = {
            **main_file, "mp_world_size": run.spec.tp_size,
            "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": run.spec.tp_size},
            fm.FOLDING_METADATA_KEY: run.record("dense", param_families=families),
        }
    return out


def local_copies(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """A module state's tensors as this rank holds them (its TP slices), copied to the CPU."""
    return {k: local_tensor(v).detach().to("cpu", copy=True) for k, v in state.items()}


def _cpu(value: Any) -> Any:
    if torch.is_tensor(value):
        return local_tensor(value).detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cpu(v) for v in value)
    return value


def summary_entries(run: FoldedRun | None, deepspeed_files_written: bool) -> dict[str, Any]:
    """What shardwise's summary records of a folded save (``{}`` unfolded): the layout (rank 0's
    model-file record: the sizes and the dense group) and whether DeepSpeed's files were written."""
    if run is None:
        return {}
    record = fm.make_folding_metadata(
        tp_size=run.spec.tp_size, tp_rank=0, ep_size=run.spec.ep_size, ep_rank=0, zero_partition_group="dense_dp",
        zero_partition_rank=0, zero_partition_count=run.spec.dp_size, family="dense",
    )
    return {fm.FOLDING_METADATA_KEY: record, "deepspeed_moe_files": deepspeed_files_written}


# ---------------------------------------------------------------------- load
def check_before_load(path: Path, kind: str, run: FoldedRun, layers: list[MoELayerRecord]) -> None:
    """A folded run's check of checkpoint ``path`` (``kind`` as :func:`~shardwise.checkpoint.layout.detect_kind`
    says) against its layout: shardwise's summary, then this rank's DeepSpeed model, expert and optimizer
    files where present (the model file is required when the summary says DeepSpeed's files were written).

    Raises:
        RuntimeError: a record is missing or differs (the message names the file, the axis and the fix).
    """
    spec = run.spec
    dense: dict[str, Any] = dict(family="dense", zero_partition_group="dense_dp", zero_partition_count=spec.dp_size)
    expert: dict[str, Any] = dict(family="routed_expert", zero_partition_group="edp",
                                  zero_partition_count=spec.edp_size, tp_rank=run.tp_rank, ep_rank=run.ep_rank)
    written = True
    if kind == "shardwise":
        summary = layout.read_summary(path)
        fm.validate_runtime_folding(summary, folding_spec=spec, where=f"{path} (shardwise's summary)", **dense)
        written = bool(summary.get("deepspeed_moe_files", True))
    main = path / run.model_file()
    if main.is_file() or written:
        if not main.is_file():
            raise RuntimeError(f"{path}: {main.name}, DeepSpeed's model file of tensor-parallel rank {run.tp_rank}, "
                               "is missing; fix: load the checkpoint directory as it was saved")
        fm.validate_runtime_folding(_header(main), folding_spec=spec, tp_rank=run.tp_rank, where=str(main), **dense)
    files = [Path(expert_ckpt_name(path, r.layer_id, e, None, checkpoint_mp_rank=run.tp_rank)) for r in layers
             for e in range(run.ep_rank * (r.num_experts // spec.ep_size),
                            (run.ep_rank + 1) * (r.num_experts // spec.ep_size))]
    files.append(path / Path(optim_ckpt_name("", "", run.ep_rank, run.tp_rank)).name)
    for file in files:
        if file.is_file():
            fm.validate_runtime_folding(_header(file), folding_spec=spec, where=str(file), **expert)


def _header(path: Path) -> dict[str, Any]:
    """A DeepSpeed file's entries (tensors memory-mapped, not read)."""
    loaded = deepspeed_files.load_file(path)
    return loaded if isinstance(loaded, dict) else {}
