"""The one rule for the identifiers a user gives pilotrun: run ids (``--run-id``), task ids (``--task-id``) and names
(a spec's or a campaign's ``name``, ``pilot.variants.custom``'s variants, ``ledger --name``).

Each may become a folder under ``--out`` (``runs/<run id>``), a file name (``pilotrun archive``'s ``<run id>.tar.gz``)
or a ledger key, so each must be one harmless path component on every filesystem: 1 to ``limit`` letters, digits,
``.``, ``_`` or ``-``, starting with a letter or digit, never ``..``. Checked once where it enters — the command
line's flag (``cli.common.id_arg``: exit 2 naming the flag) or the spec's field (a ``SpecError`` naming it) — and
trusted after.

The ids pilotrun makes pass it: ``ledger.records.new_run_id`` is ``<name>-<YYYYmmdd-HHMMSS>-<8 hex>``, a name at
most NAME_MAX long, and a campaign's runs add ``-rNN``.

Example::

    id_problem("tiny-sft-20260101-120000-0a1b2c3d")   # None
    id_problem("../../x")                              # "no path separator and no '..' (got '../../x'); ..."
"""
from __future__ import annotations

import re

# A run id, a task id ($SKYPILOT_TASK_ID: "sky-managed-2023-07-06-21-18-31-563597_my-job-name_1-0"): far below a
# file name's 255 bytes, so `<id>.tar.gz` and `runs/<id>` are always valid names.
ID_MAX = 128
# A name starts run ids: NAME_MAX + "-YYYYmmdd-HHMMSS-8hex" (25) + a campaign run's "-rNNN" stays within ID_MAX.
NAME_MAX = 81
ALLOWED = "letters, digits, '.', '_' or '-'"
_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def _shown(value: str) -> str:
    return repr(value) if len(value) <= 40 else f"{value[:40]!r}…"


def id_problem(value: object, limit: int = ID_MAX) -> str | None:
    """Why ``value`` cannot be an identifier at most ``limit`` characters long (None: it can); the message says the
    rule. The one check every run id, task id and name passes."""
    if not isinstance(value, str) or not value:
        return f"give 1 to {limit} {ALLOWED} (got {value!r})"
    if "\0" in value:
        return f"contains a NUL byte ({_shown(value)}); use {ALLOWED}"
    if len(value) > limit:
        return f"use at most {limit} characters (got {len(value)}: {_shown(value)})"
    if "/" in value or "\\" in value or ".." in value:
        return (f"it becomes one folder or file name: no path separator and no '..' (got {_shown(value)}); use "
                f"{ALLOWED}")
    if not _ID_RE.fullmatch(value):
        return f"use {ALLOWED}, starting with a letter or digit (got {_shown(value)})"
    return None


def name_problem(name: object) -> str | None:
    """Why ``name`` cannot name a pilot, a campaign or a variant (None: it can): the rule, at most NAME_MAX."""
    return id_problem(name, NAME_MAX)
