"""The import hook behind the generated ``deepspeed`` package: names resolve through the table.

:func:`activate` turns the ``deepspeed`` module into a :class:`ForwardingModule` and installs
:class:`ForwardingFinder` so that ``import deepspeed.<path>`` creates one for any path the table
(:mod:`shardwise.compat.table`) knows, has a shardwise twin for, or holds sub-paths of. An
attribute is looked up in the path's sources in order; a name found nowhere raises an
``AttributeError`` (an ``ImportError`` for ``from ... import``) that names ``deepspeed.<path>.<name>``
and says shardwise does not provide it, never a silent stand-in.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType
from typing import Any

from shardwise.compat import table


class MissingDeepSpeedName(AttributeError):
    """A ``deepspeed.<path>.<name>`` that shardwise does not provide."""


def _missing_message(qualname: str, searched: tuple[str, ...]) -> str:
    where = ", ".join(searched) if searched else "no shardwise module"
    return (
        f"{qualname} is not provided by shardwise (the installed 'deepspeed' package is shardwise's "
        f"compatibility layer; searched: {where}). Use the shardwise equivalent if there is one, or "
        "remove the call; `shardwise compat status` shows what is installed"
    )


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def sources_of(path: str) -> tuple[str, ...]:
    """The shardwise modules searched for names of ``deepspeed.<path>``, in order.

    Example:
        >>> sources_of("deepspeed.runtime.engine")
        ('shardwise.engine',)
    """
    if path in table.SOURCES:
        return table.SOURCES[path]
    twin = table.shardwise_twin(path)
    return (twin,) if _module_exists(twin) else ()


def is_known_path(path: str) -> bool:
    """True when ``deepspeed.<path>`` can be imported: it has sources or holds sub-paths."""
    if path == table.ROOT or path in table.PACKAGES or sources_of(path):
        return True
    prefix = path + "."
    return any(key.startswith(prefix) for key in (*table.SOURCES, *table.RENAMES))


def resolve(path: str, name: str) -> Any:
    """The object ``deepspeed.<path>.<name>`` stands for.

    Raises:
        MissingDeepSpeedName: shardwise provides no such name.
    """
    qualname = f"{path}.{name}"
    if qualname in table.RENAMES:
        module_name, attr = table.RENAMES[qualname].split(":")
        return getattr(importlib.import_module(module_name), attr)
    if is_known_path(qualname) and not name.startswith("__"):
        return importlib.import_module(qualname)
    searched = sources_of(path)
    for module_name in searched:
        module = importlib.import_module(module_name)
        try:
            return getattr(module, name)
        except AttributeError:
            continue
    raise MissingDeepSpeedName(_missing_message(qualname, searched))


def _cacheable(value: object) -> bool:
    """Modules, classes and functions are cached on the forwarding module; plain values (flags,
    counters, an ``mpu``) are not, since the shardwise module may change them (``configure()``
    rebinding ``deepspeed.checkpointing.PARTITION_ACTIVATIONS``) and a cached copy would go stale."""
    return isinstance(value, ModuleType | type) or callable(value)


def _owner(path: str, name: str) -> ModuleType | None:
    """The shardwise module a ``deepspeed.<path>.<name>`` assignment goes to: the rename's target
    module, else the first source module that has the name (None: nobody has it)."""
    qualname = f"{path}.{name}"
    if qualname in table.RENAMES:
        module_name, attr = table.RENAMES[qualname].split(":")
        return importlib.import_module(module_name) if attr == name else None
    for module_name in sources_of(path):
        module = importlib.import_module(module_name)
        if hasattr(module, name):
            return module
    return None


class ForwardingModule(ModuleType):
    """A ``deepspeed.<path>`` module whose attributes come from :func:`resolve`.

    Modules, classes and functions are cached; other values are read from shardwise on every
    access. Assigning a name a shardwise module provides assigns it there (a script setting one
    of DeepSpeed's module globals, or a test monkeypatching a function, changes what shardwise
    does, as it would change what DeepSpeed does); other names are set on this module.
    """

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__") and f"{self.__name__}.{name}" not in table.RENAMES:
            raise AttributeError(name)
        value = resolve(self.__name__, name)
        if _cacheable(value):
            vars(self)[name] = value
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        # The import system binds each imported ``deepspeed.<path>`` submodule on its parent: local,
        # unless the parent re-exports a same-named object (a RENAMES entry: ``deepspeed.utils``'s
        # ``z3_leaf_module`` is the function, as DeepSpeed's package binds it after the submodule).
        if isinstance(value, ForwardingModule) and f"{self.__name__}.{name}" in table.RENAMES:
            return
        local = name.startswith("__") or isinstance(value, ForwardingModule)
        owner = None if local else _owner(self.__name__, name)
        if owner is None:
            super().__setattr__(name, value)
            return
        setattr(owner, name, value)
        vars(self).pop(name, None)  # drop a cached copy: the next read resolves again

    def __delattr__(self, name: str) -> None:
        if name in vars(self):
            super().__delattr__(name)
            return
        owner = None if name.startswith("__") else _owner(self.__name__, name)
        if owner is None:
            raise AttributeError(name)
        delattr(owner, name)

    def __dir__(self) -> list[str]:
        names: set[str] = set(super().__dir__())
        for module_name in sources_of(self.__name__):
            names.update(n for n in dir(importlib.import_module(module_name)) if not n.startswith("_"))
        return sorted(names)


class ForwardingFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Creates a :class:`ForwardingModule` for ``import deepspeed.<path>``."""

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(table.ROOT + "."):
            return None
        if not is_known_path(fullname):
            raise ModuleNotFoundError(_missing_message(fullname, ()), name=fullname)
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = ForwardingModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: ModuleType) -> None:
        sources = sources_of(module.__name__)
        module.__doc__ = f"{module.__name__}, forwarded to shardwise ({', '.join(sources)})"
        spec = importlib.util.find_spec(sources[0]) if sources else None
        if spec is not None and spec.origin and spec.has_location:
            module.__file__ = spec.origin  # where the code lives: inspect.getsource reads the first source


_FINDER = ForwardingFinder()


def activate(module_name: str = table.ROOT) -> None:
    """Make ``sys.modules[module_name]`` (the generated ``deepspeed`` package) forward its names,
    and answer ``import deepspeed.<path>`` from then on. Idempotent."""
    module = sys.modules[module_name]
    module.__class__ = ForwardingModule
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    import shardwise

    major, minor, patch = (int(part) for part in table.DEEPSPEED_VERSION.split("."))
    vars(module).update(
        __version__=table.DEEPSPEED_VERSION,
        version=table.DEEPSPEED_VERSION,  # DeepSpeed's ``deepspeed.version`` (openrlhf compares it)
        __version_major__=major,
        __version_minor__=minor,
        __version_patch__=patch,
        __git_hash__="shardwise",
        __git_branch__="shardwise",
        __shardwise_version__=shardwise.__version__,
    )
