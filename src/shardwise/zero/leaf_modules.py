"""ZeRO-3 leaf modules (DeepSpeed's ``deepspeed.utils.set_z3_leaf_modules`` and friends).

A *leaf* module is gathered as one unit at stage 3: shardwise makes it one FSDP2 shard unit and
splits nothing under it (one all-gather brings all of its parameters before its forward), which is
what a mixture-of-experts block needs when only some experts run on a given batch (a per-expert
gather would wait for ranks that route nothing there). The flag is DeepSpeed's public module
attribute ``_z3_leaf`` (transformers sets it through these functions for Mixtral / Qwen-MoE
blocks); :mod:`shardwise.zero.fsdp_wrap` reads it when it chooses the units. Set it before
``initialize``: flags set after the model is sharded change nothing (a warning says so).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

LEAF_FLAG = "_z3_leaf"


def z3_leaf_module(model: nn.Module) -> bool:
    """Whether ``model`` itself is flagged as a leaf module."""
    return bool(getattr(model, LEAF_FLAG, False))


def z3_leaf_parameter(param: torch.Tensor) -> bool:
    """Whether ``param`` belongs to a leaf module (DeepSpeed marks those ``ds_z3_leaf_module``)."""
    return hasattr(param, "ds_z3_leaf_module")


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` flagged as leaves, in ``modules()`` order."""
    return [m for m in model.modules() if z3_leaf_module(m)]


def set_z3_leaf_module(model: nn.Module, flag: bool) -> None:
    """Flag (or unflag) ``model`` itself."""
    setattr(model, LEAF_FLAG, flag)


def leaf_module_names(model: nn.Module) -> tuple[str, ...]:
    """The qualified names of the flagged modules (what the stage-3 wrap policy makes units of)."""
    return tuple(name for name, m in model.named_modules() if z3_leaf_module(m))


def _class_matches(module: nn.Module, wanted: type | str) -> bool:
    if isinstance(wanted, type):
        return isinstance(module, wanted)
    cls = type(module)
    return wanted in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}")


def _set_by_class(
    model: nn.Module, leaf_module_classes: Sequence[type | str], flag: bool, raise_if_not_found: bool
) -> list[nn.Module]:
    bad = [c for c in leaf_module_classes if not isinstance(c, (type, str))]
    if bad:
        raise TypeError(f"leaf_module_classes must be classes or class names, got {bad!r}")
    matched = [m for m in model.modules() if any(_class_matches(m, c) for c in leaf_module_classes)]
    for module in matched:
        set_z3_leaf_module(module, flag)
    if not matched and raise_if_not_found:
        raise ValueError(
            f"no module of {list(leaf_module_classes)} in the model ({type(model).__name__}); "
            "fix: pass the classes (or class names) of modules the model contains"
        )
    return matched


def set_z3_leaf_modules(
    model: nn.Module, leaf_module_classes: Sequence[type | str], raise_if_not_found: bool = True
) -> list[nn.Module]:
    """Flag every module of ``model`` that is an instance of one of ``leaf_module_classes`` (classes,
    bare class names or ``module.Class`` paths) as a leaf; returns them."""
    return _set_by_class(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(
    model: nn.Module, leaf_module_classes: Sequence[type | str], raise_if_not_found: bool = True
) -> list[nn.Module]:
    """Clear the leaf flag of the matching modules; returns them."""
    return _set_by_class(model, leaf_module_classes, False, raise_if_not_found)


def set_z3_leaf_modules_by_name(
    model: nn.Module, module_names: Sequence[str], flag: bool = True, raise_if_not_found: bool = True
) -> tuple[list[nn.Module], list[str]]:
    """Flag the modules named in ``model.named_modules()``; returns them and the missing names."""
    by_name = dict(model.named_modules())
    found = [by_name[n] for n in module_names if n in by_name]
    missing = [n for n in module_names if n not in by_name]
    for module in found:
        set_z3_leaf_module(module, flag)
    if missing and raise_if_not_found:
        raise ValueError(f"no module named {missing} in the model; fix: use names from model.named_modules()")
    return found, missing


def set_z3_leaf_modules_by_suffix(
    model: nn.Module, module_name_suffixes: Sequence[str], flag: bool = True, raise_if_not_found: bool = True
) -> tuple[list[nn.Module], list[str]]:
    """Flag the modules whose qualified name ends with one of ``module_name_suffixes``; returns them
    and the suffixes that matched nothing."""
    found: list[nn.Module] = []
    missing: list[str] = []
    for suffix in module_name_suffixes:
        hits = [m for name, m in model.named_modules() if name == suffix or name.endswith("." + suffix)]
        (found.extend(hits) if hits else missing.append(suffix))
    for module in found:
        set_z3_leaf_module(module, flag)
    if missing and raise_if_not_found:
        raise ValueError(f"no module name ends with {missing}; fix: use suffixes of model.named_modules() names")
    return found, missing
