"""AutoEP expert tensors in DeepSpeed's universal checkpoint layout: the per-rank fragments of a
ZeRO-1/2 expert-parallel run (each rank holds its experts' slice) joined into one tensor per
parameter over all experts, with the marks DeepSpeed's universal loader reads for expert tensors.
"""

from __future__ import annotations

import os
from typing import Any

import torch

STATE_KEYS = ("fp32", "exp_avg", "exp_avg_sq")
"""The per-parameter states joined: the fp32 master weight and Adam's two moments."""
PARAM, EP_IS_EXPERT_PARAM, EP_NUM_EXPERTS = "param", "is_expert_param", "ep_num_experts"
"""Keys of a universal expert-state file (DeepSpeed's ``checkpoint.constants`` names)."""


def _zero12_fragment_path(temp_dir: str, param_name: str, state_key: str, dp_rank: int) -> str:
    """Where data-parallel rank ``dp_rank``'s fragment of ``param_name``'s ``state_key`` is kept
    while converting (``<temp>/<param>/0/<state>.<dp rank>``)."""
    return os.path.join(temp_dir, param_name, "0", f"{state_key}.{dp_rank:02d}")


def _edp_members(ep_rank: int, dp_world: int, ep_size: int, data_first: bool) -> list[int]:
    """The data-parallel ranks holding expert-parallel rank ``ep_rank``'s experts, in the order of
    their ZeRO partitions (its expert-data-parallel group). Expert groups are runs of ``ep_size``
    consecutive ranks, so that group is every ``ep_size``-th rank from ``ep_rank``; with
    ``data_first`` (DeepSpeed's ``use_data_before_expert_parallel_``) it is a run of consecutive ranks."""
    replicas = dp_world // ep_size
    if data_first:
        return [ep_rank * replicas + d for d in range(replicas)]
    return [ep_rank + ep_size * d for d in range(replicas)]


def consolidate_autoep_zero12_expert_states(temp_dir: str, output_dir: str, metadata: dict[str, dict[str, Any]],
                                            shapes: dict[str, tuple[int, ...]], dp_world: int, tp_world: int,
                                            data_first: bool) -> None:
    """Join each expert parameter's fragments (``metadata[name]``: ``num_experts``,
    ``num_local_experts``, ``ep_size``; ``shapes[name]``: one expert-parallel rank's slice shape)
    (each data-parallel rank's ZeRO-1/2 fragment, ``<temp>/<name>/0/<state>.<rank>``)
    into ``<output>/zero/<name>/<state>.pt`` files holding ``{param: [num_experts, ...], ...}``,
    and copy the step count. ``tp_world`` > 1 is refused (experts are never tensor-sliced here)."""
    if tp_world != 1:
        raise ValueError(f"tp_world = {tp_world}: AutoEP expert states are joined for tensor-parallel size 1; "
                         "fix: convert a checkpoint written without tensor parallelism")
    for name, meta in metadata.items():
        ep_size, num_experts = int(meta["ep_size"]), int(meta["num_experts"])
        if num_experts != int(meta["num_local_experts"]) * ep_size:
            raise ValueError(f"{name}: num_experts {num_experts} != num_local_experts "
                             f"{meta['num_local_experts']} x ep_size {ep_size}; the metadata is inconsistent")
        members = [_edp_members(e, dp_world, ep_size, data_first) for e in range(ep_size)]
        local_shape = tuple(shapes[name])
        out_dir = os.path.join(output_dir, "zero", name)
        os.makedirs(out_dir, exist_ok=True)
        for key in STATE_KEYS:
            pieces = []
            for ranks in members:  # one expert-parallel rank: its ZeRO partitions, flat, then its slice shape
                flat = torch.cat([torch.load(_zero12_fragment_path(temp_dir, name, key, r), weights_only=False)
                                  .reshape(-1) for r in ranks])
                pieces.append(flat[: torch.Size(local_shape).numel()].reshape(local_shape))
            joined = torch.cat(pieces, dim=0)
            torch.save({PARAM: joined, EP_IS_EXPERT_PARAM: True, EP_NUM_EXPERTS: num_experts},
                       os.path.join(out_dir, f"{key}.pt"))
        step_file = _zero12_fragment_path(temp_dir, name, "step", 0)
        if os.path.exists(step_file):
            torch.save(torch.load(step_file, weights_only=False), os.path.join(out_dir, "step.pt"))
