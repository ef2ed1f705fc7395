"""Reading JSONL files with errors that name the file, the line and the field."""
from __future__ import annotations

import json
from pathlib import Path


class DataError(Exception):
    """Data that cannot be used as given; the message names the file, line and fix."""


def read_jsonl(path: Path, required: tuple[str, ...]) -> list[dict]:
    rows: list[dict] = []
    try:
        fh = open(path, encoding="utf-8")
    except OSError as exc:
        raise DataError(f"cannot open {path}: {exc.strerror}") from None
    with fh:
        for lineno, line in enumerate(fh, 1):
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
