"""Names inside a shardwise checkpoint (no torch here).

Every tensor is stored at its real shape under a key that names what it is, so a
checkpoint can be read without the model that wrote it:

==========================  ========================================================
``model/<name>``            the module's ``state_dict`` entry (parameters in the training
                            dtype, frozen parameters, buffers)
``master/<name>``           the fp32 master weights, when they are not the parameters
                            (16-bit training); otherwise ``model/<name>`` is the fp32 value
``optim/<name>/<key>``      optimizer state: element-wise tensors at the parameter's shape
                            (``exp_avg``...), scalars (``step``)
``optim/param_groups``      per param group: hyperparameters and the parameter names
``common``                  counters, scheduler, loss scaler, step hooks, client state, config
``rank/<r>``                per-rank state: RNG states, data-loader position
==========================  ========================================================
"""

from __future__ import annotations

from collections.abc import Collection

MODEL = "model/"
MASTER = "master/"
OPTIM = "optim/"
PARAM_GROUPS = "optim/param_groups"
PARAM_NAMES = "shardwise_param_names"  # inside a param group; torch reserves "param_names"
COMMON = "common"
RANK = "rank/"

FORMAT = "shardwise-dcp"
FORMAT_VERSION = 2  # 2: the summary records every file's checksum (1: no checksums)


def model_key(name: str) -> str:
    """``model/<name>``."""
    return MODEL + name


def master_key(name: str) -> str:
    """``master/<name>``."""
    return MASTER + name


def rank_key(rank: int) -> str:
    """``rank/<r>``."""
    return f"{RANK}{rank}"


def fp32_source(name: str, saved: Collection[str]) -> str | None:
    """The key holding a parameter's fp32 value: the master if saved, else the model entry."""
    for key in (master_key(name), model_key(name)):
        if key in saved:
            return key
    return None
