"""A job spec's errors: ConfigError, and `config_error`, which turns what the spec's schema (workers.config,
parsed strictly by pydantic) refuses into one line naming the field (``train.steps: expected an integer,
got 'ten' (str)``; ``resources.standby_per_node=1000000 is more than Elastron accepts (at most 16)``).
Only the first refusal is told: one line, never an echo of a long input."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from pydantic import ValidationError


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


_TYPES = {"int_type": "an integer", "int_parsing": "an integer", "float_type": "a number",
          "float_parsing": "a number", "bool_type": "true or false", "bool_parsing": "true or false",
          "string_type": "a string", "list_type": "a list", "dict_type": "a mapping", "dataclass_type": "a mapping",
          "typed_dict_type": "a mapping", "model_type": "a mapping", "none_required": "null"}
_SHOWN = 60
"""Characters of a refused input a message repeats at most."""


def _shown(v: Any) -> str:
    """`v` as a message repeats it: short, whatever its size or depth."""
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 10**30:
        return f"a {len(str(abs(v)))}-digit number"
    if isinstance(v, (list, tuple, dict, set)):
        return repr(v) if not v else f"a {type(v).__name__} of {len(v)} {'entry' if len(v) == 1 else 'entries'}"
    if isinstance(v, str) and len(v) > _SHOWN:
        return f"{v[:_SHOWN]!r}... ({len(v)} characters)"
    return repr(v)[:2 * _SHOWN]


def _dotted(loc: tuple[str | int, ...]) -> str:
    out = ""
    for p in loc:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "config"


def _known_fields(root: type, loc: tuple[str | int, ...]) -> list[str]:
    """The field names of the section (or typed mapping) at `loc` under `root`, for an unknown-field message."""
    tp: Any = root
    for p in loc:
        hints = typing.get_type_hints(tp, include_extras=True) if isinstance(tp, type) else {}
        tp = hints.get(p) if isinstance(p, str) else None
        while typing.get_origin(tp) in (typing.Annotated, typing.Union) or type(tp).__name__ == "UnionType":
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            tp = args[0] if args else None
    if dataclasses.is_dataclass(tp):
        return [f.name for f in dataclasses.fields(tp)]
    return list(getattr(tp, "__annotations__", {}))


def config_error(e: ValidationError, *, root: type, prefix: tuple[str, ...] = ()) -> ConfigError:
    """The first of `e`'s refusals as a ConfigError in one line, its `loc` the field's path in the spec
    (`prefix` + pydantic's location). `root`: the class validated (for the names of known fields). A rule
    that raised a ConfigError itself (a rule between fields) keeps its message and its location."""
    err = e.errors(include_url=False)[0]
    cause = (err.get("ctx") or {}).get("error")
    loc = (*prefix, *err["loc"])
    if isinstance(cause, ConfigError):
        return ConfigError(str(cause), loc=cause.loc or loc)
    where, v, kind, ctx = _dotted(loc), err.get("input"), err["type"], err.get("ctx") or {}
    if kind in ("unexpected_keyword_argument", "extra_forbidden"):
        parent = loc[:-1]
        known = ", ".join(_known_fields(root, tuple(parent[len(prefix):])))
        return ConfigError(f"{_dotted(parent)}: unknown field {loc[-1]!r}; known fields: {known}", loc=loc)
    if kind in _TYPES:
        return ConfigError(f"{where}: expected {_TYPES[kind]}, got {_shown(v)} ({type(v).__name__})", loc=loc)
    if kind == "literal_error":
        choices = [x.strip().strip("'") for x in ctx.get("expected", "").replace(" or ", ", ").split(",")]
        return ConfigError(f"{where}: expected one of {choices}, got {_shown(v)}", loc=loc)
    if kind in ("less_than_equal", "less_than"):
        bound = ctx.get("le", ctx.get("lt"))
        most = f"at most {bound}" if kind == "less_than_equal" else f"less than {bound}"
        return ConfigError(f"{where}={_shown(v)} is more than Elastron accepts ({most})", loc=loc)
    if kind in ("greater_than", "greater_than_equal"):
        op, bound = (">", ctx.get("gt")) if kind == "greater_than" else (">=", ctx.get("ge"))
        return ConfigError(f"{where} must be {op} {bound}, got {_shown(v)}", loc=loc)
    if kind in ("string_too_long", "too_long"):
        n = len(v) if isinstance(v, (str, list, dict, tuple)) else "too many"
        unit = "characters" if kind == "string_too_long" else "entries"
        return ConfigError(f"{where} has {n} {unit}; at most {ctx.get('max_length')}", loc=loc)
    if kind == "finite_number":
        return ConfigError(f"{where}: expected a finite number, got {_shown(v)}", loc=loc)
    if kind == "missing":
        return ConfigError(f"{where} is required", loc=loc)
    if cause is not None:  # a plain ValueError from a rule
        return ConfigError(f"{where}: {cause}", loc=loc)
    return ConfigError(f"{where}: {err['msg']}", loc=loc)
