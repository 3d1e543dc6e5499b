"""``deepspeed.initialize`` as the clients reach it: shardwise's ``initialize`` after one client check.

On a machine without GPUs, accelerate (and so the Trainer) counts the processes only when it is
given a process-group backend; otherwise it believes it runs alone on every rank, fills the
config's ``"auto"`` batch sizes for one process and feeds every rank the same batches. That is
caught here, before the config is read, with the fix, instead of as a batch-size mismatch.
"""

from __future__ import annotations

import sys
from typing import Any

from shardwise import comm
from shardwise.initialization import initialize as shardwise_initialize

CPU_BACKEND_FIX = (
    "give accelerate the backend before it starts: Accelerator(kwargs_handlers=[InitProcessGroupKwargs("
    'backend="gloo")]) in an accelerate script; for the Trainer, os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"; '
    'accelerate.PartialState(backend="gloo") before TrainingArguments(..., accelerator_config='
    '{"use_configured_state": True}) (README, "Use with Hugging Face")'
)


def client_world_mismatch() -> str | None:
    """Why accelerate's view of the job disagrees with ``torch.distributed``'s, or None when it agrees
    (or accelerate is not in use)."""
    state_module = sys.modules.get("accelerate.state")
    if state_module is None or not comm.is_initialized():
        return None
    state = state_module.PartialState._shared_state
    if not state:
        return None
    seen, world = int(state.get("num_processes", 1)), comm.get_world_size()
    if seen == world:
        return None
    return (
        f"accelerate counts {seen} process(es) but torch.distributed has {world} ranks "
        f"(accelerate's backend is {state.get('backend')!r}): {CPU_BACKEND_FIX}"
    )


def initialize(*args: Any, **kwargs: Any) -> Any:
    """``deepspeed.initialize`` for the clients: :func:`shardwise.initialize` once accelerate's process
    count matches the job's.

    Raises:
        RuntimeError: accelerate sees a different number of processes than there are ranks.
    """
    problem = client_world_mismatch()
    if problem is not None:
        raise RuntimeError(problem)
    return shardwise_initialize(*args, **kwargs)
