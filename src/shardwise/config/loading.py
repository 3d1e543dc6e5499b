"""Turning what the user handed us (a path, a dict, a JSON string) into a plain dict.

Files are parsed with hjson, so comments (``//``, ``#``), unquoted keys and trailing
commas work, as they do in DeepSpeed. Duplicate keys are an error: the second value
would otherwise silently win. A string that is not a file is tried as JSON/hjson text,
then as URL-safe base64 (the launcher's and DeepSpeed's encoding).
"""

from __future__ import annotations

import base64
import binascii
import copy
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import hjson

from shardwise.config.errors import ConfigError


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, Any]:
    seen: dict[str, object] = {}
    duplicates = []
    for key, value in pairs:
        if key in seen:
            duplicates.append(key)
        seen[key] = value
    if duplicates:
        raise ConfigError(
            ", ".join(sorted(set(duplicates))),
            "the key appears more than once in the same object; only one value can be used",
            "remove the duplicate so the file says what it means",
        )
    return seen


def _parse_text(text: str, origin: str) -> dict[str, Any]:
    try:
        data = hjson.loads(text, object_pairs_hook=_no_duplicates)
    except ConfigError:
        raise
    except Exception as exc:  # hjson raises HjsonDecodeError and ValueError subclasses
        raise ConfigError(
            "", f"{origin} is not valid JSON or hjson: {exc}", "check the line and column named above"
        ) from exc
    if not isinstance(data, Mapping):
        raise ConfigError(
            "",
            f"{origin} must hold a JSON object at the top level, found {type(data).__name__}",
            "wrap the settings in { ... }",
        )
    return _to_plain(data)


def _to_plain(obj: object) -> Any:
    if isinstance(obj, Mapping):
        return {str(k): _to_plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_to_plain(v) for v in obj]
    return obj


def _read_file(path: Path) -> str:
    """The file's text, or a ConfigError naming the file and what went wrong."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(
            "",
            f"config file {str(path)!r} cannot be read: {exc.strerror or exc}",
            "check that the file exists and that this user may read it (ls -l)",
        ) from exc
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise ConfigError(
            "",
            f"config file {str(path)!r} is not UTF-8 text: byte 0x{data[exc.start]:02x} at offset "
            f"{exc.start} (line {line}) cannot be decoded",
            "save the file as UTF-8 (JSON files must be UTF-8), e.g. iconv -f latin1 -t utf-8",
        ) from exc


def read_config_source(source: str | os.PathLike[str] | Mapping[str, object]) -> tuple[dict[str, Any], str]:
    """Return ``(config dict, description of where it came from)``.

    The caller's dict is deep-copied, so resolution never modifies it.

    Example:
        >>> read_config_source({"train_batch_size": 8})[0]
        {'train_batch_size': 8}
    """
    if isinstance(source, Mapping):
        return copy.deepcopy(_to_plain(source)), "<dict>"
    if isinstance(source, os.PathLike):
        source = os.fspath(source)
    if not isinstance(source, str):
        raise ConfigError(
            "",
            f"a config must be a path, a dict or a JSON string, got {type(source).__name__}",
            "pass the path of your ds_config.json, or the dict itself",
        )
    path = Path(source)
    if len(source) < 4096 and path.is_file():
        return _parse_text(_read_file(path), str(path)), str(path)
    stripped = source.strip()
    if stripped.startswith("{"):
        return _parse_text(stripped, "the config string"), "<json string>"
    try:
        padded = stripped + "=" * (-len(stripped) % 4)
        decoded = base64.urlsafe_b64decode(padded.encode("ascii")).decode("utf-8")
        if decoded.strip().startswith("{"):
            return _parse_text(decoded, "the base64 config string"), "<base64 string>"
    except (binascii.Error, UnicodeError, ValueError):
        pass
    if stripped.endswith((".json", ".hjson", ".conf")) or os.sep in stripped:
        raise ConfigError(
            "", f"config file {source!r} does not exist", "check the path (relative to the working directory)"
        )
    raise ConfigError(
        "",
        "the config string is neither an existing file, JSON text, nor base64-encoded JSON",
        "pass a path to an existing ds_config.json, a dict, or JSON text",
        value=source if len(source) < 80 else source[:77] + "...",
    )
