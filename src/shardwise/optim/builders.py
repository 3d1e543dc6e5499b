"""One builder per ``ds_config.json`` optimizer family, and :data:`OPTIMIZERS`, the name -> builder table
that :func:`shardwise.optim.registry.build_optimizer` looks ``optimizer.type`` up in.

Each builder checks the keys of ``optimizer.params`` against what its class accepts (a
``KeyedValueError`` with a did-you-mean otherwise), applies DeepSpeed's defaults and refusals for
that family, and picks torch's fused kernels where torch has them (:func:`_kernel_flags`).
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch

from shardwise.config.errors import KeyedValueError
from shardwise.optim.adam import AdamNoBiasCorrection
from shardwise.optim.fused_adam import DeepSpeedCPUAdam, FusedAdam
from shardwise.optim.lamb import Lamb
from shardwise.optim.lion import Lion
from shardwise.optim.muon import MuonWithAdamW
from shardwise.optim.onebit_adam import OneBitAdam
from shardwise.optim.onebit_lamb import OneBitLamb
from shardwise.optim.zero_one_adam import ZeroOneAdam
from shardwise.utils.logging import logger

__all__ = ["OPTIMIZERS", "OptimizerFactory"]

# Kernel choice for torch's Adam/AdamW. Measured on this project's 2-core CPU box (torch 2.13,
# AdamW, ~10M fp32 params, lr=1e-3, weight_decay=0.01, min of 15 steps after warm-up):
#   one 10M tensor           fused  7.4 ms/step   foreach 40.4 ms/step
#   10 x 1M tensors          fused  9.3 ms/step   foreach 153.9 ms/step (noisy box; median 352)
#   152 x 65k + 152 x 256    fused  8.8 ms/step   foreach 36.8 ms/step
# fused wins by ~4x on CPU (foreach has no CPU fast path: it loops per tensor), and it is
# torch's fastest choice on CUDA too, so fused is used wherever torch supports it.
_FUSED_DEVICES_FALLBACK = frozenset({"cpu", "cuda", "mps", "xpu", "hpu"})

OptimizerFactory = Callable[..., torch.optim.Optimizer]
"""``factory(type_name, params, model_parameters, *, offload) -> Optimizer``; ``params`` is a
private copy the factory may pop from."""


# --------------------------------------------------------------------------- helpers


def _param_tensors(model_parameters: list[Any]) -> list[torch.Tensor]:
    """Flatten a list of tensors or param-group dicts into tensors."""
    tensors: list[torch.Tensor] = []
    for item in model_parameters:
        if isinstance(item, dict):
            tensors.extend(item.get("params", []))
        elif isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor):
            tensors.append(item[1])  # (name, param) pairs, accepted by torch >= 2.6
        else:
            tensors.append(item)
    return tensors


def _fused_devices() -> frozenset[str]:
    try:  # private but stable since torch 2.0; the fallback covers a rename
        from torch.optim.optimizer import _get_fused_kernels_supported_devices

        return frozenset(_get_fused_kernels_supported_devices())
    except ImportError:  # pragma: no cover - depends on the torch version
        return _FUSED_DEVICES_FALLBACK


def _kernel_flags(
    params: dict[str, object], model_parameters: list[Any], *, offload: bool, cpu_only_fused: bool = False
) -> dict[str, bool]:
    """``{"fused": True}`` where torch has fused kernels for these params, else ``{"foreach": True}``.

    An explicit ``fused``/``foreach`` in the config wins. With ``offload`` the optimizer runs
    on CPU copies of the parameters, so the choice is made for CPU.
    """
    if "fused" in params or "foreach" in params:
        return {}
    tensors = _param_tensors(model_parameters)
    if not tensors:
        return {}
    device_types = {"cpu"} if offload else {t.device.type for t in tensors}
    fused_devices = {"cpu"} if cpu_only_fused else _fused_devices()
    if device_types <= fused_devices and all(torch.is_floating_point(t) for t in tensors):
        return {"fused": True}
    return {"foreach": True}


def _accepted_keys(cls: type) -> set[str] | None:
    """Constructor keyword names of ``cls`` (without ``params``), or None if it takes ``**kwargs``."""
    names: set[str] = set()
    for name, p in inspect.signature(cls).parameters.items():
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            return None
        if name == "params" or p.kind is inspect.Parameter.VAR_POSITIONAL:
            continue
        names.add(name)
    return names


def _check_keys(type_name: str, target: str, params: dict[str, object], accepted: Iterable[str]) -> None:
    """Raise a KeyedValueError for the first key of ``params`` not in ``accepted``."""
    accepted = sorted(set(accepted))
    for key in params:
        if key not in accepted:
            close = difflib.get_close_matches(key, accepted, n=1, cutoff=0.6)
            hint = f' Did you mean "{close[0]}"?' if close else ""
            raise KeyedValueError(
                f'optimizer "{type_name}" ({target}): unknown key "optimizer.params.{key}".{hint} '
                f"Accepted keys: {', '.join(accepted)}.",
                f"optimizer.params.{key}",
                params[key],
            )


def _construct(
    type_name: str,
    cls: type[torch.optim.Optimizer],
    model_parameters: list[Any],
    params: dict[str, Any],
    extra_accepted: Iterable[str] = (),
) -> torch.optim.Optimizer:
    accepted = _accepted_keys(cls)
    if accepted is not None:
        _check_keys(type_name, cls.__name__, params, accepted | set(extra_accepted))
    if isinstance(params.get("betas"), list):
        params["betas"] = tuple(params["betas"])  # JSON has no tuples; keep param_groups tidy
    logger.info("optimizer %s -> %s(%s)", type_name, cls.__name__, params)
    return cls(model_parameters, **params)


# --------------------------------------------------------------------------- factories

_ADAM_POPPED = ("adam_w_mode", "torch_adam", "fp32_optimizer_states", "bias_correction")


def _build_adam(
    type_name: str,
    params: dict[str, object],
    model_parameters: list[object],
    *,
    offload: bool,
    force_adamw: bool = False,
) -> torch.optim.Optimizer:
    adam_w_mode = bool(params.pop("adam_w_mode", True)) or force_adamw
    torch_adam = bool(params.pop("torch_adam", False))
    # CPU-Adam's switch for fp32 moments; torch keeps moments in the params' dtype, and the
    # sharded optimizer hands us fp32 master weights, so it is fp32 here either way.
    params.pop("fp32_optimizer_states", None)
    bias_correction = bool(params.pop("bias_correction", True))
    if params.get("amsgrad", False) and not torch_adam:
        raise KeyedValueError(
            f'optimizer "{type_name}": "amsgrad": true is not supported by DeepSpeed\'s FusedAdam, '
            'whose behaviour shardwise follows. Fix: remove it, or add "torch_adam": true to use '
            "torch's AMSGrad.",
            "optimizer.params.amsgrad",
            params["amsgrad"],
        )
    if not torch_adam:
        params.pop("amsgrad", None)
    if not bias_correction:
        if torch_adam:
            raise KeyedValueError(
                f'optimizer "{type_name}": "bias_correction": false cannot be combined with '
                '"torch_adam": true, because torch.optim.Adam/AdamW always bias-correct. Fix: drop '
                "torch_adam to get the uncorrected FusedAdam update, or drop bias_correction.",
                "optimizer.params.bias_correction",
                False,
            )
        # torch has no switch for it; our foreach implementation of FusedAdam's uncorrected update.
        for key in ("fused", "foreach"):
            params.pop(key, None)
        params.setdefault("weight_decay", 0.0)
        params["adam_w_mode"] = adam_w_mode
        return _construct(type_name, AdamNoBiasCorrection, model_parameters, params)
    params.setdefault("lr", 1e-3)
    params.setdefault("betas", (0.9, 0.999))
    params.setdefault("eps", 1e-8)
    params.update(_kernel_flags(params, model_parameters, offload=offload))
    if torch_adam:  # torch's own class, with torch's defaults (AdamW: weight_decay 0.01)
        cls: type[torch.optim.Optimizer] = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
        return _construct(type_name, cls, model_parameters, params, _ADAM_POPPED)
    # DeepSpeed's classes, as DeepSpeed builds them (CPU Adam under optimizer offload): the same
    # torch Adam update (AdamW mode: decoupled weight decay, exactly torch's AdamW), so a script's
    # isinstance(optimizer, FusedAdam) holds. FusedAdam's default weight decay is 0.
    params.setdefault("weight_decay", 0.0)
    if offload:
        params["adamw_mode"] = adam_w_mode
        return _construct(type_name, DeepSpeedCPUAdam, model_parameters, params, _ADAM_POPPED)
    params["adam_w_mode"] = adam_w_mode
    return _construct(type_name, FusedAdam, model_parameters, params, _ADAM_POPPED)


def _adam(type_name: str, params: dict[str, object], model_parameters: list[object], *, offload: bool):
    return _build_adam(type_name, params, model_parameters, offload=offload)


def _adamw(type_name: str, params: dict[str, object], model_parameters: list[object], *, offload: bool):
    return _build_adam(type_name, params, model_parameters, offload=offload, force_adamw=True)


def _adagrad(type_name: str, params: dict[str, object], model_parameters: list[object], *, offload: bool):
    # torch's fused Adagrad exists for CPU only.
    params.update(_kernel_flags(params, model_parameters, offload=offload, cpu_only_fused=True))
    return _construct(type_name, torch.optim.Adagrad, model_parameters, params)


def _lamb(type_name: str, params: dict[str, object], model_parameters: list[object], *, offload: bool):
    return _construct(type_name, Lamb, model_parameters, params)


def _lion(type_name: str, params: dict[str, object], model_parameters: list[object], *, offload: bool):
    return _construct(type_name, Lion, model_parameters, params)


# The 1-bit Adams' own numeric keys (their constructors have no adam_w_mode/torch_adam).
_ONEBIT_ADAM_KEYS = frozenset(
    {"lr", "bias_correction", "betas", "eps", "eps_inside_sqrt", "weight_decay", "amsgrad"}
)


def _refuse_eps_inside_sqrt(type_name: str, params: dict[str, object]) -> None:
    if params.pop("eps_inside_sqrt", False):
        raise KeyedValueError(
            f'optimizer "{type_name}": "eps_inside_sqrt": true is not supported for the Adam '
            "update. Fix: remove it (the default, false, adds eps after the square root).",
            "optimizer.params.eps_inside_sqrt",
            True,
        )


def _onebit_adam(type_name: str, params: dict[str, object], model_parameters: list[object], *, offload: bool):
    _check_keys(
        type_name,
        "OneBitAdam",
        params,
        _ONEBIT_ADAM_KEYS | {"freeze_step", "cuda_aware", "comm_backend_name"},
    )
    _refuse_eps_inside_sqrt(type_name, params)
    _refuse_amsgrad(type_name, params)
    return _construct(type_name, OneBitAdam, model_parameters, params)


def _refuse_amsgrad(type_name: str, params: dict[str, object]) -> None:
    if params.get("amsgrad", False):
        raise KeyedValueError(
            f'optimizer "{type_name}": "amsgrad": true is not supported by the 1-bit optimizers (DeepSpeed '
            "raises for it too). Fix: remove it.",
            "optimizer.params.amsgrad",
            params["amsgrad"],
        )


def _refuse_max_grad_norm(type_name: str, params: dict[str, object]) -> None:
    if params.get("max_grad_norm", 0.0):
        raise KeyedValueError(
            f'optimizer "{type_name}": "max_grad_norm" has no effect in DeepSpeed\'s {type_name} (it is '
            'accepted and ignored there). Fix: remove it and set the top-level "gradient_clipping" instead.',
            "optimizer.params.max_grad_norm",
            params["max_grad_norm"],
        )


_ZERO_ONE_ADAM_KEYS = _ONEBIT_ADAM_KEYS | {
    "max_grad_norm",
    "var_freeze_step",
    "var_update_scaler",
    "local_step_scaler",
    "local_step_clipper",
    "cuda_aware",
    "comm_backend_name",
}


def _zero_one_adam(type_name: str, params: dict[str, object], model_parameters: list[object], *, offload: bool):
    _check_keys(type_name, "ZeroOneAdam", params, _ZERO_ONE_ADAM_KEYS)
    _refuse_eps_inside_sqrt(type_name, params)
    _refuse_amsgrad(type_name, params)
    _refuse_max_grad_norm(type_name, params)
    return _construct(type_name, ZeroOneAdam, model_parameters, params)


def _onebit_lamb(type_name: str, params: dict[str, object], model_parameters: list[object], *, offload: bool):
    _check_keys(type_name, "OneBitLamb", params, _accepted_keys(OneBitLamb) or ())
    _refuse_eps_inside_sqrt(type_name, params)
    _refuse_amsgrad(type_name, params)
    _refuse_max_grad_norm(type_name, params)
    return _construct(type_name, OneBitLamb, model_parameters, params)


def _mup(class_name: str) -> OptimizerFactory:
    def factory(type_name: str, params: dict[str, object], model_parameters: list[object], *, offload: bool):
        try:
            import mup  # optional dependency, imported only when asked for
        except ImportError as exc:
            raise KeyedValueError(
                f'optimizer "{type_name}" comes from the muP package, which is not installed. '
                "Fix: install it with `pip install mup`, or choose another optimizer type.",
                "optimizer.type",
                type_name,
            ) from exc
        return _construct(type_name, getattr(mup, class_name), model_parameters, params)

    return factory


_MUON_ACCEPTED = ("lr", "momentum", "weight_decay", "muon_lr", "adam_lr", "ns_method", "betas", "eps", "adam_w_mode")


def _muon(type_name: str, params: dict[str, object], model_parameters: list[object], *, offload: bool):
    """DeepSpeed's Muon: :class:`~shardwise.optim.muon.MuonWithAdamW` over groups flagged ``use_muon``
    (``initialize`` splits the model's groups as DeepSpeed does; plain tensors split by dimension)."""
    _check_keys(type_name, "MuonWithAdamW", params, _MUON_ACCEPTED)
    if params.pop("adam_w_mode", True) is not True:
        raise KeyedValueError(
            f'optimizer "{type_name}": "adam_w_mode": false (L2-coupled Adam for the non-matrix half) is not '
            "implemented; the AdamW half decays weights decoupled. Fix: remove adam_w_mode.",
            "optimizer.params.adam_w_mode",
            False,
        )
    betas = params.get("betas")
    if isinstance(betas, list):
        params["betas"] = tuple(betas)
    groups: list[Any] = list(model_parameters)
    if groups and isinstance(groups[0], dict) and "use_muon" in groups[0]:
        settings = {k: v for k, v in params.items() if k not in ("muon_lr", "adam_lr")}
    else:  # a probe or plain tensors: split here (matrices Muon), with DeepSpeed's per-half lr keys
        from shardwise.optim.muon_groups import muon_param_groups

        tensors = _param_tensors(groups)
        for t in tensors:
            if not hasattr(t, "use_muon"):
                setattr(t, "use_muon", t.dim() >= 2)  # noqa: B010 - DeepSpeed's dynamic parameter attribute
        groups = muon_param_groups([{"params": tensors}], params)
        settings = {}
    kernel = _kernel_flags({}, _param_tensors(groups), offload=offload)
    logger.info("optimizer %s -> MuonWithAdamW(%s)", type_name, params)
    return MuonWithAdamW(groups, adam_kernel=kernel, **settings)


OPTIMIZERS: dict[str, OptimizerFactory] = {
    "adam": _adam,
    "adamw": _adamw,
    "adagrad": _adagrad,
    "lamb": _lamb,
    "lion": _lion,
    "onebitadam": _onebit_adam,
    "zerooneadam": _zero_one_adam,
    "onebitlamb": _onebit_lamb,
    "muadam": _mup("MuAdam"),
    "muadamw": _mup("MuAdamW"),
    "musgd": _mup("MuSGD"),
    "muon": _muon,
}
"""Lower-cased JSON ``optimizer.type`` -> factory. These names are matched case-insensitively."""
