"""Where each ``deepspeed.<path>`` is found in shardwise: the forwarding table.

``SOURCES[path]`` lists the shardwise modules searched, in order, for ``deepspeed.<path>.<name>``.
A path with no entry falls back to the shardwise module of the same dotted path
(``deepspeed.checkpointing`` -> ``shardwise.checkpointing``, ``deepspeed.compression`` ->
``shardwise.compression``, ``deepspeed.ops.sparse_attention`` -> ``shardwise.ops.sparse_attention``)
when it exists, so a module added to shardwise reaches the clients without a new entry here.
``RENAMES`` maps single names whose shardwise spelling differs.
"""

from __future__ import annotations

ROOT = "deepspeed"
"""The package name the clients import."""

DEEPSPEED_VERSION = "0.19.8"
"""The DeepSpeed release whose API and config shardwise follows; the compatibility package's version
is ``<this>+shardwise.<shardwise version>`` so clients' version checks (accelerate: >= 0.9.3) pass."""

SOURCES: dict[str, tuple[str, ...]] = {
    "deepspeed": ("shardwise", "shardwise.compat.ds_utils"),
    "deepspeed.comm": ("shardwise.comm", "shardwise.comm.torch_api"),
    "deepspeed.zero": ("shardwise.zero",),
    "deepspeed.accelerator": ("shardwise.compat.accelerator",),
    "deepspeed.utils": (
        "shardwise.compat.ds_utils",
        "shardwise.utils.logging",
        "shardwise.zero.param_access",
    ),
    "deepspeed.utils.logging": ("shardwise.utils.logging",),
    "deepspeed.utils.tensor_fragment": ("shardwise.zero.param_access",),
    "deepspeed.utils.zero_to_fp32": ("shardwise.compat.zero_to_fp32",),
    "deepspeed.checkpoint.utils": ("shardwise.compat.ds_utils",),
    "deepspeed.checkpoint": ("shardwise.compat.ds_utils",),
    "deepspeed.runtime.engine": ("shardwise.engine",),
    "deepspeed.runtime.lr_schedules": ("shardwise.compat.constants", "shardwise.schedulers"),
    "deepspeed.runtime.zero": ("shardwise.zero",),
    "deepspeed.runtime.zero.partition_parameters": ("shardwise.compat.partition_parameters",),
    "deepspeed.runtime.utils": ("shardwise.compat.ds_utils",),
    "deepspeed.runtime.config": ("shardwise.config",),
    "deepspeed.launcher.runner": ("shardwise.compat.constants", "shardwise.launcher.command"),
    "deepspeed.ops.adam": ("shardwise.compat.ops",),
    "deepspeed.ops.adagrad": ("shardwise.compat.ops",),
    "deepspeed.ops.lion": ("shardwise.compat.ops",),
    "deepspeed.ops.lamb": ("shardwise.compat.ops",),
}

RENAMES: dict[str, str] = {
    "deepspeed.initialize": "shardwise.compat.client_checks:initialize",
    "deepspeed.DeepSpeedEngine": "shardwise.engine:ShardwiseEngine",
    "deepspeed.runtime.engine.DeepSpeedEngine": "shardwise.engine:ShardwiseEngine",
    "deepspeed.DeepSpeedConfig": "shardwise.config.resolve:ResolvedConfig",
    "deepspeed.runtime.config.DeepSpeedConfig": "shardwise.config.resolve:ResolvedConfig",
    "deepspeed.launcher.runner.main": "shardwise.launcher.command:main",
}

PACKAGES: frozenset[str] = frozenset({"deepspeed.runtime", "deepspeed.ops", "deepspeed.launcher"})
"""Paths that exist only to hold sub-paths (``deepspeed.runtime.engine``...)."""


def shardwise_twin(path: str) -> str:
    """The shardwise module of the same dotted path: ``deepspeed.a.b`` -> ``shardwise.a.b``.

    Example:
        >>> shardwise_twin("deepspeed.checkpointing")
        'shardwise.checkpointing'
    """
    return "shardwise" + path[len(ROOT) :]
