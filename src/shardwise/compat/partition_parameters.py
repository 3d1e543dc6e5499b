"""``deepspeed.runtime.zero.partition_parameters``: the names clients reach into.

shardwise's :class:`~shardwise.zero.Init` shards modules as they are built and does not wrap
torch's tensor constructors, so ``zero_wrapper_for_fp_tensor_constructor`` is the identity; it
exists because transformers swaps it around every ZeRO-3 model build
(``prevent_arange_dtype_change``), and its swap then changes nothing, as intended there.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from shardwise.compat.accelerator import get_accelerator
from shardwise.zero import GatheredParameters, Init, ZeroParamStatus, register_external_parameter

__all__ = [
    "GatheredParameters",
    "Init",
    "ZeroParamStatus",
    "_orig_torch_arange",
    "get_accelerator",
    "register_external_parameter",
    "zero_wrapper_for_fp_tensor_constructor",
]

_orig_torch_arange = torch.arange
"""torch's own ``arange`` (DeepSpeed keeps the original before it patches constructors)."""


def zero_wrapper_for_fp_tensor_constructor(
    fn: Callable[..., object], *args: object, **kwargs: object
) -> Callable[..., object]:
    """Returns ``fn`` unchanged: shardwise's ``zero.Init`` leaves tensor constructors alone."""
    return fn
