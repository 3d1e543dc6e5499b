"""comm.init._attempt_store: each torchrun restart attempt gets a key space of its own.

torchrun's static rendezvous keeps one agent store for the job's life; keys an attempt wrote
(a rank's gloo address, a barrier counter) must be invisible to the next attempt.
"""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace

import torch.distributed as dist

from shardwise.comm.init import _attempt_store


def test_attempts_do_not_see_each_others_keys(monkeypatch) -> None:
    agent_store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True, wait_for_workers=False)
    job = SimpleNamespace(master_addr="127.0.0.1", master_port=agent_store.port, world_size=2)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    first = _attempt_store(job, timedelta(seconds=5))  # type: ignore[arg-type]
    assert first is not None
    first.set("default_pg/0//rank_0", "old address")
    assert first.add("store_based_barrier_key:1", 1) == 1
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    second = _attempt_store(job, timedelta(seconds=5))  # type: ignore[arg-type]
    assert second is not None
    assert not second.check(["default_pg/0//rank_0"])
    assert second.add("store_based_barrier_key:1", 1) == 1  # a fresh counter, not 2
    assert first.get("default_pg/0//rank_0") == b"old address"


def test_outside_torchrun_the_env_store_is_torchs(monkeypatch) -> None:
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    job = SimpleNamespace(master_addr="127.0.0.1", master_port=1, world_size=2)
    assert _attempt_store(job, timedelta(seconds=1)) is None  # type: ignore[arg-type]
