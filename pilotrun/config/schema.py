"""A small typed-config validator: dataclasses in, every error out at once.

Each field is declared once, with its type, default and a one-line doc in
``field(metadata={"doc": ...})``; :func:`build` turns a parsed YAML mapping into
those dataclasses and collects *all* problems as ``(dotted.field, message)`` pairs
so a user fixes a spec in one pass instead of one error per run.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import types
import typing
from dataclasses import MISSING, dataclass, field
from enum import Enum
from typing import Any, Literal, Union, get_args, get_origin


class ProblemKind(Enum):
    """What is wrong with a field, for code that reacts to it (the message is for people)."""

    MISSING = "missing"  # a required key is absent
    INVALID = "invalid"  # present, but of the wrong type or value (every other problem)


class Problem(tuple[str, str]):
    """One ``(field, message)`` pair as every problem list holds them, with its :class:`ProblemKind`: code branches
    on ``kind``, never on the message's words. Plain ``(field, message)`` tuples are read as ``INVALID``."""

    kind: ProblemKind

    def __new__(cls, field: str, message: str, kind: ProblemKind = ProblemKind.INVALID) -> Problem:
        self = super().__new__(cls, (field, message))
        self.kind = kind
        return self

    def __reduce__(self):  # copy and pickle rebuild it with its kind (tuple's own reduce would drop it)
        return type(self), (self[0], self[1], self.kind)

    @staticmethod
    def kind_of(problem: tuple[str, str]) -> ProblemKind:
        return problem.kind if isinstance(problem, Problem) else ProblemKind.INVALID


class SpecError(Exception):
    """A spec that cannot run. ``problems`` lists ``(field, message)``; exit code 2."""

    def __init__(self, problems: list[tuple[str, str]], source: str = "") -> None:
        self.problems = problems
        self.source = source
        lines = [f"{f}: {m}" if f else m for f, m in problems]
        super().__init__("\n".join(lines))


def doc(text: str, default: Any = MISSING, *, extra: dict | None = None) -> Any:
    """Declare a field with its documentation (rendered into docs/spec.md)."""
    meta = {"doc": text, **(extra or {})}
    if isinstance(default, type):  # a nested section whose every field has a default
        return field(default_factory=default, metadata=meta)
    if isinstance(default, (list, dict)):
        return field(default_factory=functools.partial(type(default), default), metadata=meta)
    return field(default=default, metadata=meta)


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number"
    if tp is bool:
        return "true or false"
    if tp is str:
        return "a string"
    if tp is Any:
        return "any value"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (list, tuple):
        args = get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            return f"a list of {len(args)} values"
        return f"a list (each {_type_name(args[0])})" if args else "a list of values"
    if origin is dict:
        return "a mapping"
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(tp) if a is not type(None))
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


def _describe(value: Any) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({type(value).__name__})"


def _convert(tp: Any, value: Any, path: str, problems: list) -> Any:
    """Return ``value`` checked against ``tp``; append problems instead of raising."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        return _convert_union(tp, value, path, problems)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path, problems)  # type: ignore[arg-type]  # a class, never an instance here
    if origin is Literal:
        return _convert_literal(tp, value, path, problems)
    converter = _SCALARS.get(tp) or _CONTAINERS.get(origin)
    if converter is None:  # pragma: no cover - a schema bug, not a user error
        raise TypeError(f"unsupported schema type {tp!r} at {path}")
    ok, out = converter(tp, value, path, problems)
    if ok:
        return out
    got = "nothing (null)" if value is None else _describe(value)
    problems.append((path, f"expected {_type_name(tp)}, got {got}"))
    return value


def _convert_union(tp: Any, value: Any, path: str, problems: list) -> Any:
    args = get_args(tp)
    if value is None:
        if type(None) in args:
            return None
        problems.append((path, f"expected {_type_name(tp)}, got nothing (null)"))
        return None
    for arg in args:
        if arg is type(None):
            continue
        trial: list = []
        out = _convert(arg, value, path, trial)
        if not trial:
            return out
    # Report the most specific failure when only one non-None branch exists.
    real = [a for a in args if a is not type(None)]
    if len(real) == 1:
        return _convert(real[0], value, path, problems)
    problems.append((path, f"expected {_type_name(tp)}, got {_describe(value)}"))
    return None


def _convert_literal(tp: Any, value: Any, path: str, problems: list) -> Any:
    choices = get_args(tp)
    if value in choices and type(value) is type(choices[choices.index(value)]):
        return value
    hint = ""
    if isinstance(value, str):
        close = difflib.get_close_matches(value, [str(c) for c in choices], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
    problems.append((path, f"expected {_type_name(tp)}, got {_describe(value)}{hint}"))
    return value


# Each converter returns (accepted, value); a refusal becomes one "expected ..., got ..." problem.
def _to_bool(tp, value, path, problems) -> tuple[bool, Any]:
    return isinstance(value, bool), value


def _to_int(tp, value, path, problems) -> tuple[bool, Any]:
    return isinstance(value, int) and not isinstance(value, bool), value


def _to_str(tp, value, path, problems) -> tuple[bool, Any]:
    return isinstance(value, str), value


def _to_float(tp, value, path, problems) -> tuple[bool, Any]:
    number = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):
        # YAML 1.1 reads "1e-4" (no dot) as a string; accept it, it is what people write.
        try:
            number = float(value)
        except ValueError:
            pass
    if number is None:
        return False, value
    if not math.isfinite(number):
        problems.append((path, f"expected a finite number, got {_describe(value)}"))
    return True, number


def _to_list(tp, value, path, problems) -> tuple[bool, Any]:
    if not isinstance(value, list):
        return False, value
    (item,) = get_args(tp) or (Any,)
    return True, [_convert(item, v, f"{path}[{i}]", problems) for i, v in enumerate(value)]


def _to_tuple(tp, value, path, problems) -> tuple[bool, Any]:
    args = get_args(tp)
    open_ended = bool(args) and args[-1] is Ellipsis
    if not isinstance(value, (list, tuple)) or not (open_ended or len(value) == len(args)):
        return False, value
    if open_ended:
        return True, tuple(_convert(args[0], v, f"{path}[{i}]", problems) for i, v in enumerate(value))
    return True, tuple(_convert(a, v, f"{path}[{i}]", problems) for i, (a, v) in enumerate(zip(args, value)))


def _to_dict(tp, value, path, problems) -> tuple[bool, Any]:
    if not isinstance(value, dict):
        return False, value
    _, val_t = get_args(tp) or (Any, Any)
    return True, {str(k): _convert(val_t, v, f"{path}.{k}", problems) for k, v in value.items()}


_SCALARS = {bool: _to_bool, int: _to_int, float: _to_float, str: _to_str}
_CONTAINERS = {list: _to_list, tuple: _to_tuple, dict: _to_dict}


def _declared(f: dataclasses.Field) -> bool:
    """A key the user may write: not one set by the loader (``init=False`` or ``metadata={"internal": True}``)."""
    return f.init and not f.metadata.get("internal")


def _build(cls: type, data: Any, path: str, problems: list) -> Any:
    if hasattr(cls, "normalize"):
        data = cls.normalize(data)
    if not isinstance(data, dict):
        problems.append((path or "(top level)", f"expected a mapping, got {_describe(data)}"))
        return None
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if _declared(f)}
    allow_extra = getattr(cls, "allow_extra", None)
    extras_ok = bool(allow_extra(data)) if callable(allow_extra) else bool(allow_extra)
    kwargs: dict[str, Any] = {}
    extras: dict[str, Any] = {}
    problems_before = len(problems)
    for key, value in data.items():
        key = str(key)
        sub = f"{path}.{key}" if path else key
        if key not in fields or key == "extra":
            if extras_ok:
                extras[key] = value
                continue
            known = [k for k in fields if k != "extra"]
            close = (difflib.get_close_matches(key, known, n=1)
                     or [k for k in known if key.startswith(k) or k.startswith(key)][:1])
            hint = f"; did you mean {close[0]!r}?" if close else ""
            allowed = ", ".join(k for k in fields if k != "extra")
            problems.append((sub, f"unknown key{hint} (allowed here: {allowed})"))
            continue
        kwargs[key] = _convert(hints[key], value, sub, problems)
    for name, f in fields.items():
        if name in kwargs or name == "extra":
            continue
        if f.default is MISSING and f.default_factory is MISSING:
            sub = f"{path}.{name}" if path else name
            what = f.metadata.get("doc", "")
            message = f"missing; expected {_type_name(hints[name])}" + (f" — {what}" if what else "")
            problems.append(Problem(sub, message, ProblemKind.MISSING))
    if "extra" in fields:
        kwargs["extra"] = extras
    try:
        obj = cls(**{k: v for k, v in kwargs.items()})
    except TypeError:
        return None
    # Cross-field checks compare values: run them only on fields that have the right types.
    if hasattr(obj, "check") and len(problems) == problems_before:
        for sub, message in obj.check():
            problems.append((f"{path}.{sub}" if path and sub else (sub or path), message))
    return obj


def build(cls: type, data: Any, source: str = "") -> Any:
    """Validate ``data`` against dataclass ``cls``; raise :class:`SpecError` listing every problem."""
    problems: list[tuple[str, str]] = []
    obj = _build(cls, data, "", problems)
    if problems or obj is None:
        raise SpecError(problems or [("", "the spec is empty")], source)
    return obj


def describe_fields(cls: type, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """``(dotted name, type, default, doc)`` for every field, for the spec reference (config/reference.py)."""
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name == "extra" or not _declared(f):
            continue
        name = f"{prefix}{f.name}"
        tp = hints[f.name]
        sub = [a for a in (get_args(tp) or (tp,)) if isinstance(a, type) and dataclasses.is_dataclass(a)]
        if f.default is not MISSING:
            default = repr(f.default)
        elif f.default_factory is not MISSING:
            default = repr(f.default_factory())
        else:
            default = "required"
        if sub:
            shown = default if default in ("required", "None") else ""  # None: the section is off unless given
            rows.append((name, "mapping", shown, f.metadata.get("doc", "")))
            rows.extend(describe_fields(sub[0], name + "."))
        else:
            rows.append((name, _type_name(tp), default, f.metadata.get("doc", "")))
    return rows


__all__ = ["Problem", "ProblemKind", "SpecError", "build", "doc", "describe_fields", "dataclass"]
