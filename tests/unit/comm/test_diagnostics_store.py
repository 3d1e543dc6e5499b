"""The hang responder needs a store that serves queues: a TCP store does, a FileStore does not."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from shardwise.comm.diagnostics.responder import _has_queues


def test_only_stores_serving_queues_get_a_responder(tmp_path: Path) -> None:
    file_store = dist.FileStore(str(tmp_path / "store"), 1)  # has queue_pop, raises when it is called
    assert hasattr(file_store, "queue_pop") and not _has_queues(file_store)
    assert not _has_queues(dist.PrefixStore("p", file_store))
    tcp = dist.TCPStore("127.0.0.1", 0, 1, True)
    assert _has_queues(tcp) and _has_queues(dist.PrefixStore("p", tcp))
