"""A model larger than a memory cap, trained from NVMe (issue 21's "larger than RAM", in small).

The cap is half the model state (16 bytes per parameter, DeepSpeed's accounting): the run with
``zero.Init(remote_device="nvme")`` and parameters plus optimizer state on NVMe must add less than
the cap to the process's peak memory (``VmHWM``, the kernel's high-water mark, so no sampling),
and the same run without offload must not fit it (so the cap binds). Both must compute the same
losses and parameters, bit for bit. The full-size run (4.5B parameters, 3x the machine's RAM) is
``benchmarks/nvme_offload_bench.py``.
"""

from __future__ import annotations

import nvme_stream_cases as cases
import pytest
import torch

from shardwise.testing import run_distributed

pytestmark = pytest.mark.distributed


def test_a_model_larger_than_the_cap_trains_from_nvme(tmp_path):
    nvme = tmp_path / "nvme"
    streamed = run_distributed(cases.train, 1, args=(str(nvme),), timeout=600)[0]
    plain = run_distributed(cases.train, 1, args=(None,), timeout=600)[0]
    cap = streamed["state_mib"] / 2
    assert plain["peak_mib"] > cap, (plain["peak_mib"], cap)  # without offload it does not fit
    assert streamed["peak_mib"] < cap, (streamed["peak_mib"], cap, streamed["built_mib"])
    assert streamed["built_mib"] < plain["built_mib"] / 2  # zero.Init kept the chunks in files
    assert streamed["losses"] == plain["losses"]
    assert all(torch.equal(a, b) for a, b in zip(streamed["params"], plain["params"]))
    assert nvme.exists() and not list(nvme.rglob("*.swp"))  # the swap files went with the engine
