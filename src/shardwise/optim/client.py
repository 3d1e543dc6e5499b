"""Keep the user's optimizer object as the one that steps, over the tensors ZeRO hands it.

DeepSpeed keeps and steps the client's optimizer, so a learning-rate scheduler the script
built on it (and steps itself, or passes to ``initialize``) drives the real update. ZeRO
works on its own tensors (fp32 masters, shards, offload host copies); rather than build a
second optimizer of the same class over them, :func:`adopt_client_optimizer` re-points the
client's param groups at those tensors in place: the group dicts, their hyperparameters
(``lr``, ``initial_lr`` a scheduler wrote, ...) and every hook stay; the per-parameter state
is cleared (it was keyed by the old parameter objects).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def client_param_groups(client: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The client's param groups as fresh dicts (same hyperparameters, a copy of each params list),
    one per client group, in order: what ZeRO builds its layout from.

    Example:
        >>> w = torch.nn.Parameter(torch.zeros(2))
        >>> client_param_groups(torch.optim.SGD([w], lr=0.1))[0]["lr"]
        0.1
    """
    return [{**group, "params": list(group["params"])} for group in client.param_groups]


def adopt_client_optimizer(
    client: torch.optim.Optimizer, groups: Sequence[dict[str, Any]]
) -> torch.optim.Optimizer:
    """Re-point ``client``'s param groups at ``groups``' tensors in place and return ``client``.

    ``groups`` come from ZeRO, one per group of :func:`client_param_groups` and in the same
    order; only their ``"params"`` lists are taken (their other keys are copies of the
    client's). The state is cleared.

    Raises:
        ValueError: the number of groups differs from the client's.

    Example:
        >>> w = torch.nn.Parameter(torch.zeros(2))
        >>> opt = torch.optim.SGD([w], lr=0.1)
        >>> master = torch.zeros(2, requires_grad=True)
        >>> adopt_client_optimizer(opt, [{"params": [master], "lr": 0.1}]) is opt
        True
        >>> opt.param_groups[0]["params"][0] is master
        True
    """
    if len(groups) != len(client.param_groups):
        raise ValueError(
            f"the client optimizer has {len(client.param_groups)} param groups but ZeRO built "
            f"{len(groups)}; its groups must not change while shardwise.initialize runs"
        )
    for mine, given in zip(client.param_groups, groups):
        mine["params"] = list(given["params"])
    client.state.clear()
    return client
