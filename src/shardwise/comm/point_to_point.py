"""``deepspeed.comm``'s point-to-point calls with DeepSpeed's signatures: ``send``/``recv``,
``isend``/``irecv``, and :class:`P2POp` batches (``batch_isend_irecv``), each recorded by the comms
logger under its ``log_name`` (:func:`shardwise.comm.op_logging.timed_op`).

Example:
    >>> import torch
    >>> t = torch.zeros(2)
    >>> # works = batch_isend_irecv([P2POp(isend, t, peer=1), P2POp(irecv, t.clone(), peer=1)])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from shardwise.comm.group_type import Group
from shardwise.comm.op_logging import timed_op

__all__ = ["P2POp", "batch_isend_irecv", "irecv", "isend", "recv", "send"]


@timed_op
def send(
    tensor: torch.Tensor, dst: int, group: Group = None, tag: int = 0,
    prof: bool = False, log_name: str = "send", debug: str | None = None,
) -> None:
    """Blocking send to rank ``dst``."""
    dist.send(tensor, dst, group=group, tag=tag)


@timed_op
def recv(
    tensor: torch.Tensor, src: int | None = None, group: Group = None, tag: int = 0,
    prof: bool = False, log_name: str = "recv", debug: str | None = None,
) -> int:
    """Blocking receive into ``tensor``; returns the sender's rank."""
    return dist.recv(tensor, src, group=group, tag=tag)


@timed_op
def isend(
    tensor: torch.Tensor, dst: int, group: Group = None, tag: int = 0,
    prof: bool = False, log_name: str = "isend", debug: str | None = None,
) -> dist.Work | None:
    """Non-blocking send; returns the work handle."""
    return dist.isend(tensor, dst, group=group, tag=tag)


@timed_op
def irecv(
    tensor: torch.Tensor, src: int | None = None, group: Group = None, tag: int = 0,
    prof: bool = False, log_name: str = "irecv", debug: str | None = None,
) -> dist.Work | None:
    """Non-blocking receive; returns the work handle."""
    return dist.irecv(tensor, src, group=group, tag=tag)


_SENDS: tuple[Callable[..., Any], ...] = (isend, dist.isend)
_RECEIVES: tuple[Callable[..., Any], ...] = (irecv, dist.irecv)


class P2POp:
    """One send or receive of a :func:`batch_isend_irecv` batch.

    Args:
        op: :func:`isend` or :func:`irecv` (this module's or ``torch.distributed``'s).
        tensor: the tensor sent, or received into.
        peer: the global rank of the other side.
        group: process group (None: the world).
        tag: matches a send with its receive.
    """

    def __init__(self, op: Callable[..., Any], tensor: torch.Tensor, peer: int, group: Group = None,
                 tag: int = 0) -> None:
        if op not in _SENDS + _RECEIVES:
            raise ValueError(f"P2POp(op={op!r}): op must be deepspeed.comm.isend or deepspeed.comm.irecv")
        self.op = "isend" if op in _SENDS else "irecv"
        self.tensor, self.peer, self.group, self.tag = tensor, peer, group, tag

    def __repr__(self) -> str:
        return f"P2POp({self.op}, peer={self.peer}, shape={tuple(self.tensor.shape)}, tag={self.tag})"


@timed_op
def batch_isend_irecv(
    p2p_op_list: Sequence[P2POp], prof: bool = False, log_name: str = "batch_isend_irecv",
    debug: str | None = None,
) -> list[dist.Work]:
    """Start every send and receive of ``p2p_op_list`` as one batch; returns their work handles."""
    ops = [
        dist.P2POp(dist.isend if p.op == "isend" else dist.irecv, p.tensor, p.peer, p.group, p.tag)
        for p in p2p_op_list
    ]
    return dist.batch_isend_irecv(ops)
