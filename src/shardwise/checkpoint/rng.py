"""Random-number-generator state of one process: Python, NumPy, torch CPU and accelerator.

A resumed run draws the same dropout masks and random augmentations as an uninterrupted
one only if every generator continues from where it stopped, on every rank. (DeepSpeed saves
none of them; users resuming long runs report the divergence.)
"""

from __future__ import annotations

import random
from typing import Any

import torch

from shardwise.utils.logging import logger


def capture() -> dict[str, Any]:
    """Every generator's state, as plain picklable values.

    Example:
        >>> state = capture(); x = torch.rand(1); restore(state); bool(torch.rand(1) == x)
        True
    """
    state: dict[str, object] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
        state["cuda_device"] = torch.cuda.current_device()  # the GPU this rank draws from
    return state


def restore(state: dict[str, Any]) -> None:
    """Put back the states saved by :func:`capture` (generators it lacks are left alone)."""
    if "python" in state:
        random.setstate(state["python"])
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "numpy" in state:
        try:
            import numpy as np

            np.random.set_state(state["numpy"])
        except ImportError:
            logger.warning("the checkpoint holds a NumPy RNG state but NumPy is not installed; not restored")
    if "cuda" in state and torch.cuda.is_available():
        saved = state["cuda"]
        if len(saved) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(saved)
        else:
            # another GPU layout (e.g. one visible GPU per process now): this rank's generator continues
            # from the one its saving rank drew from, not from GPU 0's
            index = int(state.get("cuda_device", 0))
            torch.cuda.set_rng_state(saved[index] if index < len(saved) else saved[0])


def reseed(seed: int) -> None:
    """Seed every generator (ranks that did not exist when the checkpoint was saved)."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass
