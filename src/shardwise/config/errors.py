"""The one error type for bad configuration, and the did-you-mean helper.

Every problem a user can make in a config file becomes a :class:`ConfigError` that
names the key path, the value that was found, the rule it breaks and a fix. Nothing
in the config package uses ``assert`` on user input.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable

_MISSING = object()


def did_you_mean(name: str, choices: Iterable[str], cutoff: float = 0.6) -> str | None:
    """Return the closest choice to ``name`` (case-insensitive), or None.

    Example:
        >>> did_you_mean("stage3_param_persitence_threshold", ["stage3_param_persistence_threshold"])
        'stage3_param_persistence_threshold'
    """
    pool = list(choices)
    lowered = {c.lower(): c for c in pool}
    if name.lower() in lowered and lowered[name.lower()] != name:
        return lowered[name.lower()]
    matches = difflib.get_close_matches(name.lower(), list(lowered), n=1, cutoff=cutoff)
    return lowered[matches[0]] if matches else None


_PLACEHOLDER = re.compile(
    r"^(\$\{?[A-Za-z_]\w*\}?|\{\{.*\}\}|<[^>]+>|[A-Z][A-Z0-9]*(_[A-Z0-9]+)+,?|[A-Z]{4,},?)$"
)


def looks_like_placeholder(value: object) -> bool:
    """True for template leftovers such as ``"CONFIG_BATCH_SIZE"``, ``"${LR}"`` or ``"{{ bs }}"``."""
    return isinstance(value, str) and bool(_PLACEHOLDER.match(value.strip()))


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


class ConfigError(ValueError):
    """A configuration mistake, explained.

    Attributes:
        key: dotted key path (``"zero_optimization.stage"``), or ``""`` for the whole file.
        value: the offending value (or the sentinel when the key is missing).
        rule: what the value must satisfy.
        fix: how to correct it.
    """

    def __init__(self, key: str, rule: str, fix: str = "", value: object = _MISSING) -> None:
        self.key = key
        self.value = None if value is _MISSING else value
        self.has_value = value is not _MISSING
        self.rule = rule
        self.fix = fix
        super().__init__(self._format())

    def _format(self) -> str:
        where = f"'{self.key}'" if self.key else "the config"
        head = f"{where} = {_show(self.value)}: " if self.has_value else f"{where}: "
        text = head + self.rule
        if self.fix:
            text += f"\n  fix: {self.fix}"
        return text


class ZeRORuntimeException(Exception):
    """A ZeRO setup refused when ``initialize`` builds it (DeepSpeed's exception class, the same object
    as ``deepspeed.runtime.zero.utils.ZeRORuntimeException``)."""


class AssertedValueError(ValueError, AssertionError):
    """Bad input that DeepSpeed rejects with a bare ``assert``, explained.

    A ``ValueError`` carrying the rule and the fix, and an ``AssertionError`` too, so code written
    against DeepSpeed (and DeepSpeed's own tests) that catches DeepSpeed's exception type still
    catches it.

    Example:
        >>> isinstance(AssertedValueError("x"), (ValueError, AssertionError))
        True
    """


class AssertedConfigError(ConfigError, AssertionError):
    """A :class:`ConfigError` for a rule DeepSpeed checks with ``assert`` (see :class:`AssertedValueError`).

    Example:
        >>> isinstance(AssertedConfigError("a.b", "must be set"), AssertionError)
        True
    """


class ConfigErrors(ConfigError):
    """Several independent config mistakes found in one pass, reported together."""

    def __init__(self, errors: list[ConfigError]) -> None:
        self.errors = errors
        first = errors[0]
        super().__init__(first.key, first.rule, first.fix, first.value if first.has_value else _MISSING)

    def _format(self) -> str:  # called by ConfigError.__init__
        lines = [f"{len(self.errors)} problems in the config:"]
        for i, err in enumerate(self.errors, 1):
            body = err._format().replace("\n", "\n     ")
            lines.append(f"  {i}. {body}")
        return "\n".join(lines)


class KeyedValueError(ValueError):
    """A ``ValueError`` from a builder (optimizer, scheduler) that knows the config key it is about.

    The builders keep their own wording; :meth:`as_config_error` gives the ``ConfigError``
    that ``load_config`` reports, with the key path and the value.

    Example:
        >>> err = KeyedValueError('unknown key "lrr". Did you mean "lr"?', "optimizer.params.lrr", 0.1)
        >>> print(err.as_config_error())
        'optimizer.params.lrr' = 0.1: unknown key "lrr".
          fix: did you mean "lr"?
    """

    _FIX_MARKERS = (" Fix: ", " Did you mean ", " did you mean ")

    def __init__(self, message: str, key: str, value: object = _MISSING) -> None:
        super().__init__(message)
        self.key = key
        self.value = value

    def as_config_error(self) -> ConfigError:
        """This error as a ConfigError: the message up to its fix is the rule, the rest the fix."""
        message = str(self)
        cut = min((message.find(m) for m in self._FIX_MARKERS if m in message), default=-1)
        if cut < 0:
            rule, fix = message, "correct the value as the rule says"
        else:
            rule, fix = message[:cut], message[cut:].strip().removeprefix("Fix: ")
            fix = fix[0].lower() + fix[1:]
        return ConfigError(self.key, rule.strip(), fix.strip(), self.value)
