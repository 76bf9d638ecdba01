"""Typed settings: dataclass fields that carry their own rule, and one strict validator.

Every setting of the package is a field of a dataclass that lives beside the code that
uses it (`DivergenceSpec` in ops, `DataConfig` in data, ...), declared with `setting()`,
which attaches a `Rule`: what values are allowed, said once. `build(cls, values, prefix)`
turns a plain mapping (a config node) into the dataclass and collects every problem as a
line `key=value: must be ...`; unknown keys are problems too, with the nearest known key.

Types are strict on purpose. Hydra's grammar reads `data.packing=no` as the string 'no',
and OmegaConf's typed nodes would turn it into False; here a boolean is `true` or `false`
and a number is an int or float, never a bool or a string. That is why distill validates
its own dataclasses instead of handing them to OmegaConf as structured configs.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


class ConfigError(ValueError):
    """Settings of the wrong type, out of range, or unknown; the message lists each."""


@dataclass(frozen=True)
class Rule:
    check: Callable[[Any], bool]
    allowed: str  # completes "KEY=VALUE: must be ..."


@dataclass(frozen=True)
class Missing:
    """A mandatory value left unset (`???` in a config)."""


@dataclass(frozen=True)
class Unresolved:
    """An interpolation that cannot be resolved; `why` is the resolver's message."""

    why: str


def setting(default: Any = dataclasses.MISSING, rule: Rule | None = None, *,
            factory: Callable | None = None):
    """A dataclass field with its rule (None for a nested settings dataclass)."""
    meta = {"rule": rule}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


# --- rules ------------------------------------------------------------------------------
def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def integer(lo: int, *, hi: int | None = None, null: bool = False, also: tuple = (),
            what: str = "") -> Rule:
    extra = "".join(f" or {a}" for a in also) + (" or null" if null else "")
    top = f" and <= {hi}" if hi is not None else ""

    def ok(v):
        if v is None:
            return null
        return is_int(v) and ((v >= lo and (hi is None or v <= hi)) or v in also)
    return Rule(ok, f"an integer >= {lo}{top}{extra}{what}")


def number(lo: float, *, strict: bool, hi: float | None = None, null: bool = False,
           what: str = "") -> Rule:
    """A finite int or float above `lo` (strictly when `strict`), up to `hi` included."""
    def ok(v):
        if v is None:
            return null
        if not is_number(v) or not math.isfinite(v):
            return False
        return (v > lo if strict else v >= lo) and (hi is None or v <= hi)
    bound = f"{'>' if strict else '>='} {lo:g}" + (f" and <= {hi:g}" if hi is not None else "")
    return Rule(ok, f"a finite number {bound}{' or null' if null else ''}{what}")


def boolean() -> Rule:
    return Rule(lambda v: isinstance(v, bool),
                "true or false (a string such as 'no' or 'off' is not a boolean)")


def choice(options: Sequence, *, null: bool = False) -> Rule:
    names = ", ".join(str(o) for o in options) + (", or null" if null else "")
    return Rule(lambda v: (v is None and null) or (not isinstance(v, bool) and v in options),
                f"one of {names}")


def text(*, null: bool = False) -> Rule:
    return Rule(lambda v: (v is None and null) or (isinstance(v, str) and v.strip() != ""),
                "a non-empty string" + (" or null" if null else ""))


def mapping(*, null: bool = True) -> Rule:
    return Rule(lambda v: (v is None and null) or isinstance(v, Mapping),
                "a mapping of names to values" + (" or null" if null else ""))


def strings(*, null: bool = False, also_text: bool = False) -> Rule:
    """A list of non-empty strings (or one string, with `also_text`)."""
    def ok(v):
        if v is None:
            return null
        if isinstance(v, str):
            return also_text and v.strip() != ""
        return isinstance(v, Sequence) and all(isinstance(s, str) and s for s in v)
    return Rule(ok, "a list of strings" + (" or a string" if also_text else "")
                + (" or null" if null else ""))


def anything() -> Rule:
    return Rule(lambda v: True, "any value")


# --- the validator ----------------------------------------------------------------------
def nearest(key: str, known: Sequence[str]) -> str | None:
    found = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    return found[0] if found else None


def unknown_key(prefix: str, key: str, known: Sequence[str]) -> str:
    near = nearest(key, known)
    hint = f" (did you mean {prefix}{near}?)" if near else ""
    where = prefix[:-1] or "the config"
    return (f"{prefix}{key}: unknown key{hint}; {where} has the keys "
            f"{', '.join(sorted(known))}")


def describe(key: str, value, allowed: str, where: str = "") -> str:
    if isinstance(value, Missing):
        return f"{key} is not set (???){where}: give {allowed}"
    if isinstance(value, Unresolved):
        return f"{key} cannot be resolved ({value.why}){where}: give {allowed}"
    return f"{key}={value!r}{where}: must be {allowed}"


@functools.cache
def _hints(cls) -> dict:
    """A class's field types, resolved once (resolving string annotations compiles and
    evaluates each one: 0.45 ms a DivergenceSpec, built on every loss call)."""
    return typing.get_type_hints(cls)


def _nested(hint) -> tuple[type | None, bool]:
    """(the settings dataclass of a field, whether it is a list of them)."""
    if dataclasses.is_dataclass(hint):
        return hint, False
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    origin = typing.get_origin(hint)
    if origin in (list, Sequence) and args and dataclasses.is_dataclass(args[0]):
        return args[0], True
    if origin in (typing.Union, types.UnionType) and len(args) == 1:  # Dataclass | None
        return _nested(args[0])
    return None, False


def build(cls, values: Mapping | None, prefix: str, problems: list[str], where: str = ""):
    """`cls` built from `values`; each problem appended to `problems` (then None is returned
    for the fields at fault). Cross-field rules come from `cls.problems(self, prefix)`.
    `where` names the item in messages (" (source 'x')")."""
    values = dict(values or {})
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in values:
        if key not in fields:
            problems.append(unknown_key(prefix, key, list(fields)))
    hints = _hints(cls)
    out, before = {}, len(problems)
    for name, f in fields.items():
        key = f"{prefix}{name}"
        if name in values:
            value = values[name]
        elif f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            value = Missing()
        nested, many = _nested(hints[name])
        if nested is not None and isinstance(value, (Missing, Unresolved)):
            problems.append(describe(key, value, f"its {nested.__name__} settings", where))
            out[name] = None
            continue
        if nested is not None:
            out[name] = _build_nested(nested, many, value, key, f, problems)
            continue
        rule = f.metadata.get("rule")
        if rule is None:
            raise TypeError(f"{cls.__name__}.{name} has no rule")
        if isinstance(value, (Missing, Unresolved)) or not rule.check(value):
            problems.append(describe(key, value, rule.allowed, where))
            value = None
        out[name] = value
    obj = cls.__new__(cls)
    for name, value in out.items():
        object.__setattr__(obj, name, value)
    if len(problems) == before and hasattr(obj, "problems"):
        problems.extend(obj.problems(prefix))
    return obj


def _build_nested(nested, many: bool, value, key: str, f, problems: list[str]):
    rule = f.metadata.get("rule")
    if value is None:
        if rule is not None and rule.check(None):
            return None
        problems.append(describe(key, value, rule.allowed if rule else "a mapping"))
        return None
    if isinstance(value, nested):  # built already (a default, or given in code)
        return value
    if not many:
        if not isinstance(value, Mapping):
            problems.append(describe(key, value, "a mapping of its keys"))
            return None
        return build(nested, value, f"{key}.", problems)
    if rule is not None and not rule.check(value):
        problems.append(describe(key, value, rule.allowed))
        return None
    items = []
    for i, item in enumerate(value):
        if not isinstance(item, Mapping):
            problems.append(describe(f"{key}[{i}]", item, "a mapping of its keys"))
            continue
        label = getattr(nested, "LABEL", None)
        where = f" ({label} {item['name']!r})" if label and item.get("name") else ""
        items.append(build(nested, item, f"{key}[{i}].", problems, where))
    return items


def check(obj, prefix: str = "") -> None:
    """Validate a settings object built in code (its __post_init__ calls this)."""
    problems: list[str] = []
    build(type(obj), {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)
                      if not _is_nested(type(obj), f.name)}, prefix, problems)
    if problems:
        raise ValueError("; ".join(problems))


def _is_nested(cls, name: str) -> bool:
    return _nested(_hints(cls)[name])[0] is not None


def raise_problems(problems: list[str], what: str = "config") -> None:
    if problems:
        lines = "\n".join(f"  {p}" for p in problems)
        raise ConfigError(f"invalid {what} ({len(problems)} problem"
                          f"{'s' * (len(problems) > 1)}); fix these overrides:\n{lines}")


def parse(cls, values: Mapping | None, prefix: str = ""):
    """`cls` built from a plain mapping, or ConfigError listing every problem."""
    if isinstance(values, cls):
        return values
    problems: list[str] = []
    obj = build(cls, values, prefix, problems)
    raise_problems(problems, f"{prefix[:-1] or cls.__name__} settings")
    return obj
