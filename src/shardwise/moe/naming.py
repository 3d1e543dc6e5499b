"""Checkpoint names of expert tensors: the global expert index, whatever the expert parallelism.

Under ``ep_size = N`` rank ``r`` of an expert-parallel group holds the experts
``r * L .. r * L + L - 1`` (``L = num_experts / N``) as its local ``deepspeed_experts.0 .. L-1``.
A checkpoint names each expert tensor by its global index
(``<layer>.deepspeed_moe.experts.deepspeed_experts.<global>.<rest>``), so every expert is saved once,
by its owners, and a run with another ``ep_size`` finds each of its experts under the same name:
EP=2 resumes at EP=1 and back with equal weights.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from shardwise.moe.layer import MoE

EXPERTS_PATH = "deepspeed_moe.experts.deepspeed_experts."


def global_expert_names(module: nn.Module) -> dict[str, str]:
    """``{local state-dict / parameter name: global name}`` for every expert tensor of the MoE layers
    with ``ep_size > 1`` (empty without expert parallelism)."""
    renames: dict[str, str] = {}
    names = [n for n, _ in module.named_parameters(remove_duplicate=False)]
    names += [n for n, _ in module.named_buffers()]
    for prefix, sub in module.named_modules():
        if not isinstance(sub, MoE) or sub.ep_size == 1:
            continue
        first = sub.deepspeed_moe.ep_rank * sub.num_local_experts
        head = f"{prefix}.{EXPERTS_PATH}" if prefix else EXPERTS_PATH
        for name in names:
            if not name.startswith(head):
                continue
            local, _, rest = name[len(head) :].partition(".")
            renames[name] = f"{head}{first + int(local)}.{rest}"
    return renames


def held_elsewhere(module: nn.Module) -> Callable[[str], bool]:
    """Whether a checkpoint name is an expert tensor of one of ``module``'s MoE layers that another
    expert-parallel rank holds (a checkpoint of a smaller ``ep_size`` has it; this rank has no place
    for it, and that is expected)."""
    ranges: list[tuple[str, range]] = []
    for prefix, sub in module.named_modules():
        if isinstance(sub, MoE) and sub.ep_size > 1:
            first = sub.deepspeed_moe.ep_rank * sub.num_local_experts
            head = f"{prefix}.{EXPERTS_PATH}" if prefix else EXPERTS_PATH
            ranges.append((head, range(first, first + sub.num_local_experts)))

    def foreign(name: str) -> bool:
        for head, mine in ranges:
            if name.startswith(head):
                index = name[len(head) :].partition(".")[0]
                return index.isdigit() and int(index) not in mine
        return False

    return foreign
