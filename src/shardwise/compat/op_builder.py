"""``deepspeed.ops.op_builder``: DeepSpeed's op builders, reporting truthfully what shardwise has.

DeepSpeed's builders compile C++/CUDA extensions. shardwise compiles nothing: an op it provides is
torch-based Python (the optimizer classes in :mod:`shardwise.compat.ops`), so its builder is
compatible and ``load()`` returns the module holding that op; every other builder says it is not
compatible and ``load()`` raises naming the op and what to use instead. :data:`COMPATIBLE_OPS` is
``deepspeed.ops.__compatible_ops__`` (op name -> compatible), which DeepSpeed's tests and clients read.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any, ClassVar

_OPTIMIZERS = "shardwise.compat.ops"


class OpBuilder:
    """An op by DeepSpeed's name; ``PROVIDER`` is the shardwise module with its torch-based version, or ``""``."""

    NAME: ClassVar[str] = "deepspeed_not_implemented"
    PROVIDER: ClassVar[str] = ""
    INSTEAD: ClassVar[str] = "the torch equivalent"
    """What to use where shardwise has no version of the op."""

    def __init__(self, name: str | None = None) -> None:
        self.name = name or self.NAME

    def absolute_name(self) -> str:
        """The op's module path in DeepSpeed (``deepspeed.ops.<name>_op``)."""
        return f"deepspeed.ops.{self.name}_op"

    def is_compatible(self, verbose: bool = False) -> bool:
        """True when shardwise provides the op (torch-based, nothing to build)."""
        return bool(self.PROVIDER)

    def load(self, verbose: bool = True) -> ModuleType:
        """The shardwise module holding the op; raises naming the op where shardwise has none."""
        if not self.PROVIDER:
            raise NotImplementedError(
                f"{type(self).__name__}().load(): the DeepSpeed op {self.name!r} is a compiled extension "
                f"shardwise does not provide (it builds no C++/CUDA ops); use {self.INSTEAD}"
            )
        return importlib.import_module(self.PROVIDER)

    jit_load = load

    @staticmethod
    def is_rocm_pytorch() -> bool:
        """Whether torch is a ROCm (HIP) build (clients pick their kernels by it; Megatron does)."""
        import torch

        return getattr(torch.version, "hip", None) is not None

    @staticmethod
    def is_sycl_enabled() -> bool:
        """False: shardwise builds no SYCL extensions."""
        return False

    def builder(self) -> Any:
        """Raises: shardwise has no extension to build."""
        raise NotImplementedError(
            f"{type(self).__name__}().builder(): shardwise builds no C++/CUDA extensions; "
            + ("load() gives the torch-based op" if self.PROVIDER else f"use {self.INSTEAD}")
        )


class NotImplementedBuilder(OpBuilder):
    """What DeepSpeed's accelerator returns for a builder it lacks."""


class CPUAdamBuilder(OpBuilder):
    """``DeepSpeedCPUAdam`` (torch's Adam/AdamW kernels on the host)."""

    NAME, PROVIDER = "cpu_adam", _OPTIMIZERS


class CPUAdagradBuilder(OpBuilder):
    """``DeepSpeedCPUAdagrad``."""

    NAME, PROVIDER = "cpu_adagrad", _OPTIMIZERS


class CPULionBuilder(OpBuilder):
    """``DeepSpeedCPULion``."""

    NAME, PROVIDER = "cpu_lion", _OPTIMIZERS


class FusedAdamBuilder(OpBuilder):
    """``FusedAdam`` (torch's fused/foreach Adam)."""

    NAME, PROVIDER = "fused_adam", _OPTIMIZERS


class FusedLambBuilder(OpBuilder):
    """``FusedLamb`` (shardwise's foreach Lamb)."""

    NAME, PROVIDER = "fused_lamb", _OPTIMIZERS


class FusedLionBuilder(OpBuilder):
    """``FusedLion``."""

    NAME, PROVIDER = "fused_lion", _OPTIMIZERS


class AsyncIOBuilder(OpBuilder):
    """DeepSpeed's libaio extension; shardwise's NVMe offload reads and writes mapped files instead."""

    NAME, INSTEAD = "async_io", "zero_optimization.offload_*.device 'nvme' (shardwise's mapped-file NVMe offload)"


class GDSBuilder(OpBuilder):
    """GPUDirect Storage."""

    NAME, INSTEAD = "gds", "zero_optimization.offload_*.device 'nvme' (shardwise's mapped-file NVMe offload)"


class PinMemoryBuilder(OpBuilder):
    """DeepSpeed's pinned-memory allocator."""

    NAME, INSTEAD = "pin_memory", "torch.Tensor.pin_memory() or get_accelerator().pin_memory(t)"


class CCLCommBuilder(OpBuilder):
    """oneCCL collectives."""

    NAME, INSTEAD = "deepspeed_ccl_comm", "torch.distributed with the gloo backend (deepspeed.comm)"


class ShareMemCommBuilder(OpBuilder):
    """DeepSpeed's shared-memory CPU collectives."""

    NAME, INSTEAD = "deepspeed_shm_comm", "deepspeed.comm: shardwise's shared-memory collectives are on by default"


class QuantizerBuilder(OpBuilder):
    """DeepSpeed's quantization kernels."""

    NAME, INSTEAD = "quantizer", "zero_optimization.zero_quantized_weights/gradients (torch-based block int8)"


class FPQuantizerBuilder(OpBuilder):
    """FP8/FP6 quantizer kernels."""

    NAME, INSTEAD = "fp_quantizer", "torch's float8 dtypes"


class RandomLTDBuilder(OpBuilder):
    """Random-LTD's token gather/scatter kernels."""

    NAME, INSTEAD = "random_ltd", "data_efficiency.data_routing.random_ltd (torch-based in shardwise)"


class TransformerBuilder(OpBuilder):
    """DeepSpeed's fused training transformer kernel."""

    NAME, INSTEAD = "transformer", "the model's own transformer layers"


class StochasticTransformerBuilder(OpBuilder):
    """The stochastic-mode transformer kernel."""

    NAME, INSTEAD = "stochastic_transformer", "the model's own transformer layers"


class InferenceBuilder(OpBuilder):
    """DeepSpeed-Inference kernels."""

    NAME, INSTEAD = "transformer_inference", "the model itself (shardwise trains; it has no inference engine)"


class EvoformerAttnBuilder(OpBuilder):
    """DS4Sci Evoformer attention."""

    NAME, INSTEAD = "evoformer_attn", "torch.nn.functional.scaled_dot_product_attention"


class UtilsBuilder(OpBuilder):
    """DeepSpeed's flatten/unflatten extension."""

    NAME, INSTEAD = "utils", "torch._utils._flatten_dense_tensors / _unflatten_dense_tensors"


BUILDERS: tuple[type[OpBuilder], ...] = (
    NotImplementedBuilder, CPUAdamBuilder, CPUAdagradBuilder, CPULionBuilder, FusedAdamBuilder,
    FusedLambBuilder, FusedLionBuilder, AsyncIOBuilder, GDSBuilder, PinMemoryBuilder, CCLCommBuilder,
    ShareMemCommBuilder, QuantizerBuilder, FPQuantizerBuilder, RandomLTDBuilder, TransformerBuilder,
    StochasticTransformerBuilder, InferenceBuilder, EvoformerAttnBuilder, UtilsBuilder,
)
"""Every builder shardwise answers for, by DeepSpeed's class name."""

COMPATIBLE_OPS: dict[str, bool] = {builder.NAME: builder().is_compatible() for builder in BUILDERS}
"""``deepspeed.ops.__compatible_ops__``: op name -> whether shardwise provides it."""
