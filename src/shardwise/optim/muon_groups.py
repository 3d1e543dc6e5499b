"""Which parameters DeepSpeed's ``"optimizer": {"type": "Muon"}`` orthogonalises, and its param groups.

DeepSpeed tags every parameter of the model given to ``initialize`` with ``use_muon``: True for
the hidden weight matrices (a layer shape of two or more dimensions whose name contains neither
``embed`` nor ``lm_head``), False for the rest (embeddings, the output head, biases, norms). Each
incoming param group is then split into a Muon half and an AdamW half, with settings resolved
most-specific-last: the config's shared value, then ``muon_lr`` / ``adam_lr``, then the group's own.
The Muon half reads ``lr``, ``momentum``, ``weight_decay``, ``ns_method``; the AdamW half ``lr``,
``betas``, ``eps``, ``weight_decay``. shardwise follows both rules (written from their description).

Example:
    >>> import torch
    >>> uses_muon("blocks.0.attn.weight", (8, 8)), uses_muon("wte.embed", (8, 8)), uses_muon("ln.bias", (8,))
    (True, False, False)
    >>> w, b = torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.ones(2))
    >>> w.use_muon, b.use_muon = True, False
    >>> [(g["use_muon"], g["lr"]) for g in muon_param_groups([{"params": [w, b]}], {"lr": 0.1, "adam_lr": 0.01})]
    [(True, 0.1), (False, 0.01)]
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["ADAM_KEYS", "MUON_KEYS", "layer_shape", "muon_param_groups", "tag_muon_parameters", "uses_muon"]

MUON_KEYS = ("lr", "momentum", "weight_decay", "ns_method")
"""The config keys the Muon half of a group takes (``muon_lr`` overrides ``lr``)."""

ADAM_KEYS = ("lr", "betas", "eps", "weight_decay")
"""The config keys the AdamW half of a group takes (``adam_lr`` overrides ``lr``)."""

_NOT_HIDDEN = ("embed", "lm_head")


def layer_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The parameter's layer shape: ``ds_shape`` where ``zero.Init`` left a placeholder, else its shape."""
    shape = getattr(param, "ds_shape", None)
    return tuple(param.shape) if shape is None else tuple(shape)


def uses_muon(name: str, shape: Sequence[int]) -> bool:
    """DeepSpeed's rule: a matrix (two or more dimensions) that is not an embedding or the output head."""
    return len(shape) >= 2 and not any(word in name.lower() for word in _NOT_HIDDEN)


def tag_muon_parameters(model: nn.Module) -> int:
    """Set ``use_muon`` on every parameter of ``model`` (DeepSpeed's public attribute); returns how
    many are Muon's."""
    count = 0
    for name, param in model.named_parameters():
        flag = uses_muon(name, layer_shape(param))
        setattr(param, "use_muon", flag)  # noqa: B010 - DeepSpeed's dynamic parameter attribute
        count += int(flag)
    return count


def _half_defaults(settings: Mapping[str, Any], keys: Sequence[str], lr_key: str) -> dict[str, Any]:
    out = {key: settings[key] for key in keys if key in settings}
    if lr_key in settings:
        out["lr"] = settings[lr_key]
    return out


def muon_param_groups(groups: Iterable[Mapping[str, Any]], settings: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Each group split into its Muon half and its AdamW half (empty halves dropped), with
    ``use_muon`` and the half's settings; parameters must carry ``use_muon``.

    Raises:
        ValueError: a parameter without ``use_muon`` (not part of the model given to ``initialize``).
    """
    groups = [dict(g) for g in groups]
    untagged = [p for g in groups for p in g["params"] if not hasattr(p, "use_muon")]
    if untagged:
        raise ValueError(
            f"optimizer Muon: {len(untagged)} parameter(s) of model_parameters are not parameters of the model "
            "given to initialize, so nothing says whether Muon or AdamW trains them; fix: pass them as part "
            "of the model, or set `param.use_muon = True / False` on them"
        )
    halves = (
        (True, "muon", MUON_KEYS, _half_defaults(settings, MUON_KEYS, "muon_lr")),
        (False, "adam", ADAM_KEYS, _half_defaults(settings, ADAM_KEYS, "adam_lr")),
    )
    out: list[dict[str, Any]] = []
    for index, group in enumerate(groups):
        own = {k: v for k, v in group.items() if k != "params"}
        trainable = [p for p in group["params"] if p.requires_grad]
        for flag, label, keys, defaults in halves:
            half = [p for p in trainable if bool(p.use_muon) is flag]
            if not half:
                continue
            prefix = own.get("name") or (f"group{index}" if len(groups) > 1 else None)
            name = f"{prefix}-{label}-params" if prefix else f"{label}-params"
            chosen = {**defaults, **{k: v for k, v in own.items() if k in keys}}
            out.append({"params": half, "use_muon": flag, "name": name, **chosen})
    return out
