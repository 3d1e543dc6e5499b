"""``deepspeed.git_version_info``: the version DeepSpeed code checks, and which ops exist (compiled: none)."""

from __future__ import annotations

import torch

from shardwise.compat.op_builder import COMPATIBLE_OPS
from shardwise.compat.table import DEEPSPEED_VERSION

version = DEEPSPEED_VERSION
"""``deepspeed.git_version_info.version``: the DeepSpeed release whose API shardwise follows."""
git_hash, git_branch = "shardwise", "shardwise"
installed_ops: dict[str, bool] = dict.fromkeys(COMPATIBLE_OPS, False)
"""Pre-built (compiled) ops: none, shardwise compiles nothing."""
compatible_ops: dict[str, bool] = dict(COMPATIBLE_OPS)
torch_info: dict[str, object] = {
    "version": ".".join(torch.__version__.split("+")[0].split(".")[:2]),
    "bf16_support": True,
    "cuda_version": "0.0" if torch.version.cuda is None else ".".join(torch.version.cuda.split(".")[:2]),
    "nccl_version": "0.0" if not torch.cuda.is_available() else ".".join(map(str, torch.cuda.nccl.version()[:2])),
    "hip_version": "0.0" if getattr(torch.version, "hip", None) is None else torch.version.hip,
}
"""``deepspeed.git_version_info.torch_info``: the torch, CUDA and NCCL versions in use."""
