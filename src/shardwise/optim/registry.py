"""Optimizers by their ``ds_config.json`` name (spec §3.2).

Name resolution, in order:

1. ``type.lower()`` in :data:`OPTIMIZERS` (case-insensitive DeepSpeed names: ``adam``, ``adamw``,
   ``lamb``, ``lion``, ``adagrad``, the 1-bit family, the muP trio, ``muon``).
2. Otherwise ``type`` looked up **case-sensitively** in ``torch.optim`` (``SGD``, ``RMSprop``...),
   with ``params`` passed straight to the constructor.
3. Otherwise a ``ValueError`` with the choices and a did-you-mean.

Adam defaults follow DeepSpeed's FusedAdam, not torch: ``weight_decay=0`` even for AdamW, whose
torch default is 0.01. The exception is ``torch_adam: true``, where DeepSpeed hands ``params`` to
torch's class and so inherits torch's own defaults (AdamW ``weight_decay=0.01``); we mirror that
divergence on purpose (spec §3.2.1, verified), so a config trains the same under both.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from shardwise.config.errors import KeyedValueError
from shardwise.optim.adam import AdamNoBiasCorrection
from shardwise.optim.builders import OPTIMIZERS, _construct
from shardwise.optim.fused_adam import DeepSpeedCPUAdam, FusedAdam
from shardwise.optim.hyperparameters import check_hyperparameters
from shardwise.optim.lion import Lion
from shardwise.optim.muon import MuonWithAdamW
from shardwise.optim.names import unknown_type_error

__all__ = [
    "OPTIMIZERS",
    "ZERO_SUPPORTED_OPTIMIZERS",
    "ZERO_SUPPORTED_OPTIMIZER_CLASSES",
    "build_optimizer",
    "is_zero_supported",
    "resolve_client_optimizer",
]

# --------------------------------------------------------------------------- param groups


def _clean_param_groups(model_parameters: Iterable[Any]) -> list[object]:
    """Materialise ``model_parameters``, drop empty param groups, reject duplicated params."""
    items = list(model_parameters)
    items = [g for g in items if not (isinstance(g, dict) and len(list(g.get("params", []))) == 0)]
    items = [{**g, "params": list(g["params"])} if isinstance(g, dict) else g for g in items]
    groups = [g["params"] for g in items] if items and isinstance(items[0], dict) else [items]
    _check_no_shared_params(groups)
    return items


def _check_no_shared_params(groups: list[list[Any]]) -> None:
    seen: dict[int, int] = {}
    for gi, group in enumerate(groups):
        for p in group:
            tensor = p[1] if isinstance(p, tuple) else p
            first = seen.setdefault(id(tensor), gi)
            if first != gi:
                raise ValueError(
                    f"a parameter of shape {tuple(tensor.shape)} appears in optimizer param groups "
                    f"{first} and {gi}; each parameter may belong to one group only. Remove it from "
                    "one of the groups."
                )


def _tidy_param_groups(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Remove empty param groups in place and reject a parameter shared by two groups."""
    optimizer.param_groups[:] = [g for g in optimizer.param_groups if len(g["params"]) > 0]
    _check_no_shared_params([g["params"] for g in optimizer.param_groups])
    return optimizer


# --------------------------------------------------------------------------- public API


def build_optimizer(
    type_name: str,
    params_cfg: Mapping[str, object] | None,
    model_parameters: Iterable[object],
    *,
    offload: bool = False,
) -> torch.optim.Optimizer:
    """Build the optimizer named by ``optimizer.type`` with ``optimizer.params``.

    Args:
        type_name: ``optimizer.type`` as written in the config.
        params_cfg: ``optimizer.params`` (not modified).
        model_parameters: parameters or param-group dicts, as for any ``torch.optim`` class.
        offload: the optimizer will run on CPU copies of the parameters (ZeRO optimizer
            offload); kernels are chosen for CPU.

    Returns:
        A ``torch.optim.Optimizer`` with empty param groups removed.

    Raises:
        ValueError: unknown type or key, ``max_grad_norm``, ``"auto"``, a hyperparameter out of range
            (these are ``KeyedValueError`` naming the key), or a parameter in two groups.

    Example:
        >>> import torch
        >>> from shardwise.optim import build_optimizer
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = build_optimizer("Adam", {"lr": 3e-4}, model.parameters())
        >>> type(opt).__name__, opt.defaults["weight_decay"]
        ('FusedAdam', 0.0)
    """
    if not isinstance(type_name, str) or not type_name:
        raise KeyedValueError(
            f"optimizer.type must be a non-empty string, got {type_name!r}.", "optimizer.type", type_name
        )
    params = dict(params_cfg or {})
    if "max_grad_norm" in params:
        raise KeyedValueError(
            f'optimizer "{type_name}": "optimizer.params.max_grad_norm" is not supported (DeepSpeed '
            'rejects it too). Fix: remove it and set the top-level "gradient_clipping": '
            f"{params['max_grad_norm']} instead.",
            "optimizer.params.max_grad_norm",
            params["max_grad_norm"],
        )
    for key, value in params.items():
        if isinstance(value, str) and value == "auto":
            raise KeyedValueError(
                f'optimizer "{type_name}": "optimizer.params.{key}" is still "auto". "auto" values '
                "are filled in by the Hugging Face Trainer integration; outside it, write a number.",
                f"optimizer.params.{key}",
                value,
            )
    check_hyperparameters(type_name, params)
    groups = _clean_param_groups(model_parameters)
    factory = OPTIMIZERS.get(type_name.lower())
    if factory is not None:
        optimizer = factory(type_name, params, groups, offload=offload)
    else:
        cls = getattr(torch.optim, type_name, None)
        if not (
            isinstance(cls, type)
            and issubclass(cls, torch.optim.Optimizer)
            and cls is not torch.optim.Optimizer
        ):
            raise unknown_type_error(type_name, OPTIMIZERS)
        optimizer = _construct(type_name, cls, groups, params)
    return _tidy_param_groups(optimizer)


def resolve_client_optimizer(
    client: torch.optim.Optimizer | Callable[[Any], torch.optim.Optimizer],
    model_parameters: Iterable[object] | None = None,
) -> torch.optim.Optimizer:
    """Accept a user's optimizer instance, or a callable ``f(params) -> Optimizer``.

    A client optimizer overrides the config's ``optimizer`` section. Empty param groups are
    removed; a parameter in two groups is an error.

    Args:
        client: an optimizer, or a factory called with ``model_parameters``.
        model_parameters: what the factory receives (required for a callable).

    Returns:
        The optimizer, tidied in place.

    Example:
        >>> import torch
        >>> from shardwise.optim import resolve_client_optimizer
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = resolve_client_optimizer(lambda ps: torch.optim.SGD(ps, lr=0.1), model.parameters())
    """
    if isinstance(client, torch.optim.Optimizer):
        return _tidy_param_groups(client)
    if callable(client):
        if model_parameters is None:
            raise ValueError(
                "the optimizer passed to initialize() is a callable, so model_parameters are needed "
                "to call it; pass model_parameters=model.parameters() (or param groups)."
            )
        optimizer = client(_clean_param_groups(model_parameters))
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(
                f"the optimizer callable returned {type(optimizer).__name__}, not a "
                "torch.optim.Optimizer; it must be f(params) -> Optimizer."
            )
        return _tidy_param_groups(optimizer)
    raise ValueError(
        f"optimizer must be a torch.optim.Optimizer or a callable f(params) -> Optimizer, got "
        f"{type(client).__name__}."
    )


# --------------------------------------------------------------------------- ZeRO support

ZERO_SUPPORTED_OPTIMIZER_CLASSES: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.Adam,
    torch.optim.AdamW,
    FusedAdam,
    DeepSpeedCPUAdam,
    torch.optim.Adagrad,
    AdamNoBiasCorrection,
    Lion,
    MuonWithAdamW,  # whole matrices at every stage (shardwise.optim.muon), element-wise elsewhere
)
"""Element-wise optimizers, exact types: they give the same result on a flat ZeRO shard as on
whole tensors. Lamb is deliberately absent, as FusedLamb is from DeepSpeed's list (spec §3.2.5):
its trust ratio is a per-tensor norm, which a shard of a flat buffer does not have."""

ZERO_SUPPORTED_OPTIMIZERS: frozenset[str] = frozenset(c.__name__ for c in ZERO_SUPPORTED_OPTIMIZER_CLASSES)
"""Class names of :data:`ZERO_SUPPORTED_OPTIMIZER_CLASSES`, for messages."""


def is_zero_supported(optimizer: torch.optim.Optimizer | type) -> bool:
    """Whether ZeRO may wrap ``optimizer`` without ``zero_allow_untested_optimizer``.

    The match is on the exact type, as in DeepSpeed: a subclass may change ``step`` in ways
    that are not element-wise.

    Example:
        >>> import torch
        >>> is_zero_supported(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1))
        False
    """
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    return cls in ZERO_SUPPORTED_OPTIMIZER_CLASSES
