"""Reading JSONL files with errors that name the file, the line and the field."""
from __future__ import annotations

import json
from pathlib import Path

from ..config.yamlsafe import regular_file_problem


class DataError(Exception):
    """Data that cannot be used as given; the message names the file, line and fix."""


def read_jsonl(path: Path, required: tuple[str, ...]) -> list[dict]:
    rows: list[dict] = []
    # A FIFO or a device blocks or never ends: refused from stat() before it is opened.
    if (not_regular := regular_file_problem(path)) is not None:
        raise DataError(f"{not_regular}; give a JSONL file")
    try:
        fh = open(path, "rb")
    except OSError as exc:
        raise DataError(f"cannot open {path}: {exc.strerror}") from None
    with fh:
        for lineno, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(f"{path}:{lineno}: not UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1}); "
                                "save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{lineno}: not valid JSON ({exc.msg}); "
                                "each line must be one JSON object") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
            missing = [k for k in required if k not in row]
            if missing:
                raise DataError(f"{path}:{lineno}: missing field(s) {', '.join(missing)} "
                                f"(each row needs {', '.join(required)})")
            rows.append(row)
    if not rows:
        raise DataError(f"{path}: no rows; a JSONL file needs one JSON object per line")
    seen: dict = {}
    for i, row in enumerate(rows):
        key = str(row["id"])
        if key in seen:
            raise DataError(f"{path}: id {key!r} appears on rows {seen[key] + 1} and {i + 1}; ids must be unique")
        seen[key] = i
    return rows
