"""Reading a spec's YAML within fixed bounds: a regular file, a size, a nesting depth and an expanded size.

A spec is a few KB of nested keys. Without bounds, a FIFO or a device (``/dev/zero``) blocks or
never ends when read; ten thousand nested brackets overflow the YAML composer's recursion; and
a "billion laughs" of aliases is small as text but exponential once copied, hashed or printed.
Each bound below is far above any real spec and far below where those failures start.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import yaml

from .schema import SpecError

# The examples' specs are 1-3 KB; a campaign's, with its variants, under 10 KB.
MAX_SPEC_BYTES = 1 << 20
# The schema nests four levels (pilot.overfit.x); a model config or factory arguments a few more.
MAX_DEPTH = 64
# Values after aliases are expanded (each mapping, list and scalar counts one).
MAX_VALUES = 100_000
# A --set value is one YAML scalar, list or small mapping.
MAX_OVERRIDE_CHARS = 10_000


def file_kind(mode: int) -> str:
    """What a non-regular file is, in words, from its ``st_mode``."""
    for test, word in ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder")):
        if test(mode):
            return word
    return "not a regular file"


def regular_file_problem(path: Path) -> str | None:
    """Why ``path`` cannot be read as a file, from stat() alone (a FIFO or device is never opened); None if it can."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return f"not found: {path}"
    except OSError as exc:
        return f"cannot stat {path}: {exc.strerror}"
    if not stat.S_ISREG(st.st_mode):
        return f"{path} is {file_kind(st.st_mode)}, not a regular file"
    return None


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader that refuses nesting deeper than MAX_DEPTH while composing (before Python's recursion limit)."""

    depth = 0

    def compose_node(self, parent, index):
        self.depth += 1
        try:
            if self.depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise yaml.YAMLError(f"nested more than {MAX_DEPTH} levels deep at line {mark.line + 1}")
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1


def expanded_values(obj: Any) -> int:
    """How many values ``obj`` holds once every alias is expanded; raises ValueError on a self-reference.
    Shared (aliased) objects are counted once per reference, but walked once (memo), so this is fast."""
    memo: dict[int, int] = {}
    active: set[int] = set()

    def count(x: Any) -> int:
        if not isinstance(x, (dict, list)):
            return 1
        key = id(x)
        if key in memo:
            return memo[key]
        if key in active:
            raise ValueError("a value refers to itself through an alias")
        active.add(key)
        children = list(x.values()) if isinstance(x, dict) else x
        total = 1 + sum(count(c) for c in children)
        active.discard(key)
        memo[key] = total
        return total

    return count(obj)


def parse_bounded(text: str, where: str) -> Any:
    """YAML from ``text`` (named ``where`` in messages), within MAX_DEPTH and MAX_VALUES; SpecError otherwise."""
    try:
        data = yaml.load(text, Loader=_BoundedLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        loc = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise SpecError([("", f"{where} is not valid YAML{loc}: {getattr(exc, 'problem', None) or exc}")],
                        where) from None
    try:
        n = expanded_values(data)
    except ValueError as exc:
        raise SpecError([("", f"{where}: {exc}; a spec is a tree of keys")], where) from None
    if n > MAX_VALUES:
        raise SpecError([("", f"{where} expands to {n:,} values (aliases expanded), more than the {MAX_VALUES:,} a "
                              "spec may hold: remove the repeated aliases")], where)
    return data


def read_spec_text(path: Path) -> str:
    """The spec file's text: a regular file under MAX_SPEC_BYTES, UTF-8; SpecError naming the file otherwise."""
    problem = regular_file_problem(path)
    if problem is not None:
        raise SpecError([("", f"spec file {problem}")], str(path))
    size = os.stat(path).st_size
    if size > MAX_SPEC_BYTES:
        raise SpecError([("", f"{path} is {size:,} bytes; a spec is a few KB (at most {MAX_SPEC_BYTES:,}): is this "
                              "the data file?")], str(path))
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_SPEC_BYTES + 1)
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise SpecError([("", f"{path} is not UTF-8 text (byte 0x{data[exc.start]:02x} on line {line})")],
                        str(path)) from None
    except OSError as exc:
        raise SpecError([("", f"cannot read {path}: {exc.strerror}")], str(path)) from None


def parse_override_value(key: str, value: str) -> Any:
    """A ``--set KEY=VALUE`` value as YAML, bounded like a spec; SpecError naming --set and the key otherwise."""
    if len(value) > MAX_OVERRIDE_CHARS:
        raise SpecError([("--set", f"{key}: the value is {len(value):,} characters, more than "
                                   f"{MAX_OVERRIDE_CHARS:,}")])
    try:
        return parse_bounded(value, f"the value of {key}")
    except SpecError as exc:
        message = exc.problems[0][1]
        raise SpecError([("--set", f"{message}; quote a string value, e.g. --set '{key}=\"...\"'")]) from None
