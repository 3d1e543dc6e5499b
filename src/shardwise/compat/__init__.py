"""DeepSpeed's import paths, answered by shardwise, for clients that ``import deepspeed``.

Hugging Face's Trainer, accelerate and Lightning import ``deepspeed`` themselves. ``shardwise
compat install-deepspeed`` writes a ``deepspeed`` package that holds no logic: its
``__init__`` calls :func:`shardwise.compat.forwarding.activate`, and every ``deepspeed.<path>``
name is then looked up in :mod:`shardwise.compat.table` (explicit entries first, then the
shardwise module of the same path). A name shardwise does not provide fails with an error that
names it.

Modules here:
    forwarding: the import hook and the forwarding modules (no DeepSpeed names of its own).
    table: ``deepspeed.<path>`` -> shardwise module(s) that provide it.
    accelerator, partition_parameters, ops, ds_utils, constants: DeepSpeed-shaped names that
        have no home elsewhere in shardwise (CPU/CUDA accelerator object, ZeRO-3 helper names,
        optimizer class names, ``deepspeed.utils`` helpers, constants).
    installer: writes, describes and refuses the ``deepspeed`` package and its dist-info.
"""
