"""Which dtype each buffer of a 16-bit run keeps: ``data_types.buffer_dtype`` and
``data_types.keep_in_fp32_modules``.

Under ``bf16`` / ``fp16`` the parameters take the training dtype; buffers do not follow them (as in
DeepSpeed 0.19.8 and FSDP's ``MixedPrecisionPolicy``): a floating buffer keeps the dtype the model
gave it (a rotary ``inv_freq`` stays fp32), unless ``buffer_dtype`` names one for every floating
buffer. ``keep_in_fp32_modules`` names buffers that stay (or become) fp32 whatever ``buffer_dtype``
says, as Hugging Face transformers does when it loads a model itself:

* ``"auto"`` (default): the model's own transformers lists, ``_keep_in_fp32_modules_strict`` of any
  submodule (and ``_keep_in_fp32_modules`` too under fp16), each entry matched under that submodule;
* a list of name patterns, ``*`` standing for any characters, matched anywhere in the full buffer name;
* ``[]``: none.

Parameters named by those lists still take the training dtype (DeepSpeed's rule; shardwise keeps one
dtype for all trained parameters so its flat buffers and FSDP2 units stay uniform). fp32 runs change
no buffer. The main case is the MoE routing bias ``e_score_correction_bias`` (DeepSeek-V3 and
others), a buffer whose close values bf16 would merge.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
from torch import nn

__all__ = ["buffer_targets", "cast_for_training", "keep_in_fp32_pattern", "place_buffers"]

SIXTEEN_BIT = (torch.float16, torch.bfloat16)


def keep_in_fp32_pattern(module: nn.Module, setting: str | list[str], dtype: torch.dtype) -> re.Pattern[str] | None:
    """The names of ``module``'s buffers to keep in fp32 when training in ``dtype``, as one pattern
    (None: none).

    Example:
        >>> class Router(nn.Module):
        ...     _keep_in_fp32_modules_strict = ["bias"]
        >>> model = nn.Sequential(Router())
        >>> keep_in_fp32_pattern(model, "auto", torch.bfloat16).search("0.bias") is not None
        True
        >>> keep_in_fp32_pattern(model, [], torch.bfloat16) is None
        True
    """
    if dtype not in SIXTEEN_BIT:
        return None
    patterns: set[str] = set()
    if setting == "auto":
        for prefix, child in module.named_modules():
            names = set(getattr(child, "_keep_in_fp32_modules_strict", None) or ())
            if dtype == torch.float16:
                names |= set(getattr(child, "_keep_in_fp32_modules", None) or ())
            for name in names:
                glob = _glob(name)
                patterns.add(rf"^{re.escape(prefix)}\..*{glob}" if prefix else glob)
    else:
        patterns = {_glob(name) for name in setting}
    return re.compile("|".join(sorted(patterns))) if patterns else None


def _glob(name: str) -> str:
    return ".*".join(re.escape(part) for part in name.split("*"))


def _floating_buffers(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for prefix, owner in module.named_modules():
        for name, buf in owner._buffers.items():
            if buf is not None and buf.is_floating_point():
                yield (f"{prefix}.{name}" if prefix else name), buf


def buffer_targets(
    module: nn.Module,
    train_dtype: torch.dtype,
    buffer_dtype: torch.dtype | None,
    keep_in_fp32_modules: str | list[str],
) -> dict[int, torch.dtype]:
    """``id(buffer) -> dtype`` for the floating buffers a ``train_dtype`` run changes; a buffer not
    listed keeps its dtype. Nothing changes in an fp32 run.

    Example:
        >>> m = nn.Module()
        >>> m.register_buffer("inv_freq", torch.ones(2))
        >>> buffer_targets(m, torch.bfloat16, None, "auto")
        {}
        >>> list(buffer_targets(m, torch.bfloat16, torch.bfloat16, "auto").values())
        [torch.bfloat16]
        >>> list(buffer_targets(m, torch.bfloat16, torch.bfloat16, ["inv_*"]).values())
        []
    """
    if train_dtype not in SIXTEEN_BIT:
        return {}
    keep = keep_in_fp32_pattern(module, keep_in_fp32_modules, train_dtype)
    targets: dict[int, torch.dtype] = {}
    for name, buf in _floating_buffers(module):
        target = torch.float32 if keep is not None and keep.search(name) else buffer_dtype
        if target is not None and buf.dtype != target:
            targets[id(buf)] = target
    return targets


def place_buffers(module: nn.Module, targets: dict[int, torch.dtype], device: torch.device | None = None) -> None:
    """Give each buffer listed in ``targets`` (:func:`buffer_targets`) its dtype, and every buffer
    ``device`` when one is given; the others keep their dtype."""
    for owner in module.modules():
        for name, buf in owner._buffers.items():
            if buf is None:
                continue
            dtype = targets.get(id(buf), buf.dtype)
            if dtype != buf.dtype or (device is not None and buf.device != device):
                owner._buffers[name] = buf.to(device=device, dtype=dtype)


def cast_for_training(
    module: nn.Module, train_dtype: torch.dtype, buffer_dtype: torch.dtype | None, keep_in_fp32_modules: str | list[str]
) -> None:
    """Stages 0-2 of a 16-bit run: floating parameters take ``train_dtype`` in place (the same
    ``Parameter`` objects), buffers as :func:`buffer_targets` says."""
    targets = buffer_targets(module, train_dtype, buffer_dtype, keep_in_fp32_modules)
    with torch.no_grad():
        for param in module.parameters():
            if param.is_floating_point() and param.dtype != train_dtype:
                param.data = param.data.to(train_dtype)
    place_buffers(module, targets)
