"""Reading files pilotrun did not just write, bounded and typed; writing its own files atomically.

A file that came from disk may be anything: a link to ``/dev/zero`` (read whole, it never ends), a FIFO (opening it
waits for a writer for ever), a gigabyte, JSON nested ten thousand deep (RecursionError), or a well-formed document
of the wrong shape (a TypeError three calls later, or a negative peak printed as "-909494701772928256.0 TiB").
Every such read goes through here: a regular file only (never a device or a FIFO; never a link where ``links`` is
False), at most ``cap`` bytes, JSON checked against a small schema. A bad file is a ``FileProblem`` naming the path
and what is wrong; its ``kind`` says which, for code to branch on.

    data = read_json(path, cap=1 << 20, schema={"rows": [{"fits": bool, "device_used_bytes": NonNegative()}]})
"""
from __future__ import annotations

import errno
import json
import math
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any


class FileKind(str, Enum):
    MISSING = "missing"
    NOT_REGULAR = "not-regular"    # a device, FIFO, socket or folder; or a link where links are refused
    TOO_LARGE = "too-large"
    UNREADABLE = "unreadable"      # an OSError, or bytes that are not UTF-8
    NOT_JSON = "not-json"          # malformed, or nested too deeply to parse
    WRONG_SHAPE = "wrong-shape"    # valid JSON, but not what the schema says


class FileProblem(Exception):
    def __init__(self, path: Path, kind: FileKind, what: str) -> None:
        # "<file> is missing", "<file> cannot be read (...)"; a schema's problem names its field after a colon
        joint = " " if what.startswith(("is ", "cannot ")) else ": "
        super().__init__(f"{path}{joint}{what}")
        self.path, self.kind, self.what = Path(path), kind, what


def read_bytes(path: Path, cap: int, links: bool = False) -> bytes:
    """At most ``cap`` bytes of a regular file; FileProblem for anything else (never blocks on a FIFO)."""
    path = Path(path)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | (0 if links else getattr(os, "O_NOFOLLOW", 0))
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise FileProblem(path, FileKind.MISSING, "is missing") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise FileProblem(path, FileKind.NOT_REGULAR, "is a symbolic link, not a file") from None
        raise FileProblem(path, FileKind.UNREADABLE, f"cannot be read ({exc.strerror or exc})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FileProblem(path, FileKind.NOT_REGULAR, "is not a regular file (a device, FIFO or folder)")
        if st.st_size > cap:
            raise FileProblem(path, FileKind.TOO_LARGE, f"is {st.st_size} bytes, more than the {cap} allowed")
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", closefd=False) as fh:
            data = fh.read(cap + 1)
    except OSError as exc:
        raise FileProblem(path, FileKind.UNREADABLE, f"cannot be read ({exc.strerror or exc})") from None
    finally:
        os.close(fd)
    if len(data) > cap:  # grew while being read
        raise FileProblem(path, FileKind.TOO_LARGE, f"is more than the {cap} bytes allowed")
    return data


def parse_json(text: str | bytes, path: Path, schema: Any = None) -> Any:
    try:
        value = json.loads(text)
    except RecursionError:
        raise FileProblem(path, FileKind.NOT_JSON, "is JSON nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise FileProblem(path, FileKind.NOT_JSON, f"is not valid JSON ({exc})") from None
    if schema is not None:
        problem = check(value, schema)
        if problem:
            raise FileProblem(path, FileKind.WRONG_SHAPE, problem)
    return value


def read_json(path: Path, cap: int, schema: Any = None, links: bool = False) -> Any:
    """The JSON in ``path`` (bounded as ``read_bytes``), checked against ``schema`` when given."""
    return parse_json(read_bytes(path, cap, links), Path(path), schema)


# -- the schema: a type (or tuple of types), {key: schema} for a mapping with those keys (others allowed), [schema]
# for a list of items, Optional(schema) for a key that may be missing or null, NonNegative() for a finite number >= 0,
# MapOf(schema) for a mapping of any keys.
@dataclass(frozen=True)
class Optional:
    schema: Any


@dataclass(frozen=True)
class NonNegative:
    integer: bool = False


@dataclass(frozen=True)
class MapOf:
    """A mapping of any string keys, each value of ``schema``."""

    schema: Any


def _name(schema: Any) -> str:
    if isinstance(schema, tuple):
        return " or ".join(_name(s) for s in schema)
    if isinstance(schema, dict):
        return "a mapping"
    if isinstance(schema, list):
        return "a list"
    if isinstance(schema, NonNegative):
        return "a whole number >= 0" if schema.integer else "a finite number >= 0"
    return {str: "a string", int: "an integer", float: "a number", bool: "true or false"}.get(schema, str(schema))


def check(value: Any, schema: Any, where: str = "") -> str | None:
    """The first way ``value`` differs from ``schema``, naming the field; None when it fits."""
    here = where or "the document"
    if isinstance(schema, Optional):
        return None if value is None else check(value, schema.schema, where)
    if isinstance(schema, dict):
        if not isinstance(value, dict):
            return f"{here} is {type(value).__name__}, expected a mapping"
        for key, sub in schema.items():
            if key not in value and not isinstance(sub, Optional):
                return f"{where + '.' if where else ''}{key} is missing"
            problem = check(value.get(key), sub, f"{where + '.' if where else ''}{key}")
            if problem:
                return problem
        return None
    if isinstance(schema, MapOf):
        if not isinstance(value, dict):
            return f"{here} is {type(value).__name__}, expected a mapping"
        return next((p for k, item in value.items() if (p := check(item, schema.schema, f"{where}[{k!r}]"))), None)
    if isinstance(schema, list):
        if not isinstance(value, list):
            return f"{here} is {type(value).__name__}, expected a list"
        return next((p for i, item in enumerate(value) if (p := check(item, schema[0], f"{where}[{i}]"))), None)
    if isinstance(schema, NonNegative):
        ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
              and (not schema.integer or float(value).is_integer()))
        return None if ok else f"{here} is {value!r}, expected {_name(schema)}"
    types = schema if isinstance(schema, tuple) else (schema,)
    if float in types and int not in types:
        types = (*types, int)
    if isinstance(value, bool) and bool not in types:
        return f"{here} is {value!r}, expected {_name(schema)}"
    return None if isinstance(value, types) else f"{here} is {type(value).__name__}, expected {_name(schema)}"


# -- writing ------------------------------------------------------------------------------------------------------
DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class WriteFailed(Exception):
    """A file pilotrun writes could not be written; the message names the path, the cause and the free space."""

    def __init__(self, path: Path, exc: OSError) -> None:
        self.path, self.errno = Path(path), exc.errno
        super().__init__(write_failure_text(path, exc))


def free_bytes(path: Path) -> int | None:
    """Free bytes on the filesystem holding ``path`` (its nearest existing parent); None when unreadable."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def free_text(path: Path) -> str:
    if (free := free_bytes(path)) is None:
        return "free space not measured"
    from .humanize import human_bytes

    return f"{human_bytes(free)} free there"


def write_failure_text(path: Path, exc: OSError) -> str:
    if exc.errno in DISK_FULL:
        cause = "No space left on device" if exc.errno != errno.EFBIG else "File too large (a file size limit)"
        return f"cannot write {path}: {cause} ({free_text(path)}); free space there or pass --out on a larger disk"
    return f"cannot write {path}: {exc.strerror or exc} ({free_text(path)})"


def write_atomic(path: Path, text: str) -> None:
    """``text`` in ``path`` whole or not at all (a temp file in the same folder, fsynced, renamed over it);
    WriteFailed naming the path, the cause and the free space when the disk is full or the folder unwritable."""
    path = Path(path)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        tmp = None
    except OSError as exc:
        raise WriteFailed(path, exc) from None
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
