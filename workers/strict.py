"""Strict conversion of plain dicts (a parsed YAML file, a REST body) into the config dataclasses: unknown
keys and wrong types are refused with a message naming the field (``train.steps: expected an integer,
got 'ten' (str)``). The one parser of job specs; workers.config defines what they may say."""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from typing import Any, Literal


class ConfigError(ValueError):
    """A job config that cannot be used; the message names the field, and `loc` is its path in the spec
    (("train", "steps"); ("model", "overrides", "dim"); () when it is the whole config)."""

    def __init__(self, message: str, *, loc: tuple[str | int, ...] = ()):
        super().__init__(message)
        self.loc = tuple(loc)

    def __reduce__(self):  # crosses process boundaries (Ray) whole, loc included
        return _config_error, (str(self), self.loc)


def _config_error(message: str, loc: tuple) -> ConfigError:
    return ConfigError(message, loc=loc)


def path_of(where: str) -> tuple[str | int, ...]:
    """A parser path ("model.overrides.dim", "x[2].y") as a location tuple."""
    return tuple(int(p[1:-1]) if p.startswith("[") else p for p in re.findall(r"[^.\[\]]+|\[\d+\]", where))


def build(cls: type, d: Any) -> Any:
    """`cls` (a dataclass) from the mapping `d`, nested dataclasses included; ConfigError naming the field."""
    return _build(cls, d, "")


def _describe(v: Any) -> str:
    return f"{v!r} ({type(v).__name__})"


def _convert(tp: Any, v: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if v is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _convert(a, v, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{where}: unexpected {_describe(v)}", loc=path_of(where))
    if origin is Literal:
        if v not in args:
            raise ConfigError(f"{where}: expected one of {list(args)}, got {v!r}", loc=path_of(where))
        return v
    if dataclasses.is_dataclass(tp):
        return _build(tp, v, where)
    if origin is list:
        if not isinstance(v, list):
            raise ConfigError(f"{where}: expected a list, got {_describe(v)}", loc=path_of(where))
        return [_convert(args[0], x, f"{where}[{i}]") for i, x in enumerate(v)]
    if origin is dict:
        if not isinstance(v, dict):
            raise ConfigError(f"{where}: expected a mapping, got {_describe(v)}", loc=path_of(where))
        return dict(v)
    if tp is bool:
        if not isinstance(v, bool):
            raise ConfigError(f"{where}: expected true or false, got {_describe(v)}", loc=path_of(where))
        return v
    if tp is int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(f"{where}: expected an integer, got {_describe(v)}", loc=path_of(where))
        return v
    if tp is float:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {_describe(v)}", loc=path_of(where))
        if not math.isfinite(v):
            raise ConfigError(f"{where}: expected a finite number, got {v!r}", loc=path_of(where))
        return float(v)
    if tp is str:
        if not isinstance(v, str):
            raise ConfigError(f"{where}: expected a string, got {_describe(v)}", loc=path_of(where))
        return v
    if tp is Any:
        return v
    raise TypeError(f"unsupported config type {tp} at {where}")  # a bug in this module, not user input


def _build(cls: type, d: Any, where: str) -> Any:
    label = where or "config"
    if not isinstance(d, dict):
        raise ConfigError(f"{label}: expected a mapping, got {_describe(d)}", loc=path_of(where))
    hints = typing.get_type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in d if k not in known]
    if unknown:
        raise ConfigError(f"{label}: unknown field {unknown[0]!r}; known fields: {', '.join(known)}",
                          loc=(*path_of(where), unknown[0]))
    kwargs = {k: _convert(hints[k], v, f"{where}.{k}" if where else k) for k, v in d.items()}
    try:
        return cls(**kwargs)
    except ConfigError as e:
        if e.loc or not where:
            raise
        raise ConfigError(str(e), loc=path_of(where)) from None  # a section's own check: at least its section
    except ValueError as e:
        raise ConfigError(f"{label}: {e}", loc=path_of(where)) from None
