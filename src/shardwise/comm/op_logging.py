"""``deepspeed.comm``'s comms-logger decorator, :func:`timed_op`, and the helpers it reads a call with.

A function decorated with :func:`timed_op` is timed and recorded by the comms logger
(:mod:`shardwise.comm.comms_logger`) when it is enabled, under the call's ``log_name`` argument
(default: the signature's ``log_name`` default, else the function's name), with the message size of its
tensor argument (``tensor``, ``tensors``, ``input_list``, ``input_tensor_list`` or ``p2p_op_list``; a
list counts the sum of its tensors). ``prof=True`` profiles a call even when ``prof_all`` is off and
its name is not in ``prof_ops``. Disabled, a call pays one attribute check.

A synchronous call is recorded when it returns. An asynchronous one (it returns a work handle) is
recorded when the backend completes it (the work's future), on CPU; on CUDA, and for work without a
future (point-to-point), when it returns (on CUDA after a device synchronisation, as DeepSpeed does).

Example:
    >>> @timed_op
    ... def exchange(tensor, group=None, prof=False, log_name="exchange", debug=None):
    ...     return None
    >>> get_default_args(exchange)["log_name"]
    'exchange'
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from shardwise.comm.comms_logger import COMMS_LOGGER as _COMMS

__all__ = [
    "get_caller_func",
    "get_debug_log_name",
    "get_default_args",
    "get_msg_size_from_args",
    "get_tensor_kwarg",
    "get_tensor_position",
    "timed_op",
]

F = TypeVar("F", bound=Callable[..., Any])

# The parameter that carries a collective's data, in the order they are looked for.
_DATA_PARAMETERS = ("tensor", "tensors", "input_list", "input_tensor_list", "p2p_op_list")


def get_caller_func(frame: int = 3) -> str:
    """The name of the function ``frame`` frames up the stack (3: the caller of the caller's caller).

    Example:
        >>> def outer(): return get_caller_func(1)
        >>> outer()
        'outer'
    """
    return sys._getframe(frame).f_code.co_name


def get_default_args(func: Callable[..., Any]) -> dict[str, Any]:
    """``{parameter: default}`` for the parameters of ``func`` that have a default.

    Example:
        >>> get_default_args(lambda a, b=2, *, c="x": None)
        {'b': 2, 'c': 'x'}
    """
    return {
        name: p.default
        for name, p in inspect.signature(func).parameters.items()
        if p.default is not inspect.Parameter.empty
    }


def get_tensor_position(func: Callable[..., Any]) -> int:
    """The position of ``func``'s data parameter (see the module docstring), -1 when it has none.

    Example:
        >>> get_tensor_position(lambda output, tensor, group=None: None)
        1
    """
    names = list(inspect.signature(func).parameters)
    for name in _DATA_PARAMETERS:
        if name in names:
            return names.index(name)
    return -1


def get_tensor_kwarg(func: Callable[..., Any], kwargs: Mapping[str, Any]) -> Any:
    """The data argument of a call of ``func`` from its keyword arguments (over the defaults); None without one."""
    arguments = {**get_default_args(func), **kwargs}
    for name in _DATA_PARAMETERS:
        if name in arguments:
            return arguments[name]
    return None


def _nbytes(data: Any) -> int:
    if isinstance(data, list | tuple):  # P2POps carry their tensor
        return sum(_nbytes(getattr(item, "tensor", item)) for item in data)
    return int(data.element_size() * data.nelement())


def get_msg_size_from_args(func: Callable[..., Any], *args: Any, **kwargs: Any) -> int:
    """Bytes a call of ``func`` sends: its data argument's size, a list's summed; 0 without one (a barrier)."""
    data = None
    position = get_tensor_position(func)
    if -1 < position < len(args):
        data = args[position]
    if data is None and kwargs:
        data = get_tensor_kwarg(func, kwargs)
    return 0 if data is None else _nbytes(data)


def get_debug_log_name(func_args: Mapping[str, Any], debug: bool) -> str:
    """``func_args["log_name"]``, followed by ``| [Caller Func: <name>]`` when ``debug``."""
    name = str(func_args["log_name"])
    return f"{name} | [Caller Func: {get_caller_func()}]" if debug else name


def _world_of(arguments: Mapping[str, Any]) -> int:
    import torch.distributed as dist

    if not dist.is_initialized():
        return 1
    return int(dist.get_world_size(arguments.get("group")))


def _on_cuda(func: Callable[..., Any], args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
    position = get_tensor_position(func)
    data = args[position] if -1 < position < len(args) else get_tensor_kwarg(func, kwargs)
    while isinstance(data, list | tuple) and data:
        data = getattr(data[0], "tensor", data[0])
    return bool(getattr(data, "is_cuda", False))


def timed_op(func: F) -> F:
    """Record every call of ``func`` in the comms logger while it is enabled (see the module docstring)."""
    signature = inspect.signature(func)
    default_name = get_default_args(func).get("log_name", func.__name__)

    @functools.wraps(func)
    def logged(*args: Any, **kwargs: Any) -> Any:
        if not _COMMS.enabled:
            return func(*args, **kwargs)
        bound = signature.bind_partial(*args, **kwargs)
        name = bound.arguments.get("log_name", default_name)
        record = _COMMS.start(
            name,
            get_msg_size_from_args(func, *args, **kwargs),
            _world_of(bound.arguments),
            _on_cuda(func, args, kwargs),
            force=bool(bound.arguments.get("prof", False)),
        )
        result = func(*args, **kwargs)
        if record is not None:
            future = _future_of(result) if not record.on_cuda else None
            if future is None:
                record.complete()
            else:
                future.then(lambda _: record.complete())
        return result

    return logged  # type: ignore[return-value]


def _future_of(result: Any) -> Any:
    """The completion future of an asynchronous call's work handle; None for a synchronous call's result and
    for work without futures (point-to-point), which is then recorded when the call returns."""
    works = result if isinstance(result, list) else [result]
    if not works or not all(hasattr(w, "get_future") for w in works):
        return None
    try:
        futures = [w.get_future() for w in works]
    except RuntimeError:  # "Work::getFuture not implemented"
        return None
    if len(futures) == 1:
        return futures[0]
    import torch

    return torch.futures.collect_all(futures)
