"""Reading ``pilot.yaml``: parse (bounded), apply ``--set`` overrides, validate the schema, then the checks of
:mod:`.checks`; any problem is a :class:`~pilotrun.config.schema.SpecError` (exit 2) listing every one at once.

Example::

    spec = load_spec("examples/tiny-sft/pilot.yaml", ["train.micro_batch_size=4"])
    child = spec_from_mapping(spec.written, spec.source)   # what a worker process rebuilds
"""
from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .checks import spec_problems
from .limits import bound_problems
from .program import program_file_problems
from .schema import Problem, ProblemKind, SpecError, build
from .sections import SHAPE_ONLY_TASKS
from .spec import PROGRAM_OPTIONAL, ProgramOnlySpec, Spec
from .yamlsafe import parse_bounded, parse_override_value, read_spec_text


class ProgramSpecRefused(SpecError):
    """A program-only spec given to a command that needs model/data/train (``pilotrun variants``: it runs pilotrun's
    own loop)."""


def set_dotted(mapping: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = mapping
    for part in parts[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """'train.micro_batch_size=4' → ('train.micro_batch_size', 4); values are YAML."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise SpecError([("--set", f"expected key=value, got {text!r}")])
    return key.strip(), parse_override_value(key.strip(), value) if value.strip() else None


def apply_overrides(raw: dict, overrides: list[str]) -> list[str]:
    """``--set KEY=VALUE`` items applied to the spec's mapping, in order; the keys they set."""
    keys = []
    for item in overrides:
        key, value = parse_override(item)
        set_dotted(raw, key, value)
        keys.append(key)
    return keys


def read_raw(path: str | Path) -> tuple[dict, Path]:
    """The spec file's mapping as written (bounded parse); SpecError naming the file when it is not one."""
    p = Path(path)
    if not p.exists():
        raise SpecError([("", f"spec file not found: {p}")], str(p))
    if p.is_dir():
        raise SpecError([("", f"expected a spec file, got a folder: {p} (did you mean {p / 'pilot.yaml'}?)")], str(p))
    raw = parse_bounded(read_spec_text(p), str(p))  # a regular file, size, depth and alias expansion bounded
    if raw is None:
        raise SpecError([("", f"{p} is empty; see examples/tiny-sft/pilot.yaml")], str(p))
    if not isinstance(raw, dict):
        raise SpecError([("", f"{p} must be a mapping of keys (name, model, data, train, ...)")], str(p))
    return raw, p


def load_spec(path: str | Path, overrides: list[str] | None = None, check_files: bool = True,
              allow_program: bool = False) -> Spec:
    """Read, validate and check a spec file; raises :class:`SpecError` (exit 2) on any problem.
    ``check_files=False`` skips the data and tokenizer files (the estimator reads neither). A program-only spec
    (``program:`` without model/data/train, a :class:`ProgramOnlySpec`) is refused unless ``allow_program``."""
    raw, p = read_raw(path)
    overridden = apply_overrides(raw, overrides or [])
    spec = spec_from_mapping(raw, p, overridden, check_files)
    if isinstance(spec, ProgramOnlySpec) and not allow_program:
        raise ProgramSpecRefused([("program", "this spec pilots a program and has no model/data/train, which this "
                                   "command needs: run it with `pilotrun run`, or add model, data and train")], str(p))
    return spec


def _schema_problems(problems: list[tuple[str, str]], raw: dict) -> list[tuple[str, str]]:
    """The schema's problems, with the fix where model/data/train are missing: all of them with ``program:``, or
    ``program.command`` instead of them."""
    partial = [k for k in PROGRAM_OPTIONAL if k in raw]
    missing = [k for k in PROGRAM_OPTIONAL if k not in raw]
    if "program" in raw and partial and missing:  # some of model/data/train: say the fix, not three "missing" lines
        return [(f, m) for f, m in problems if f not in missing] + [
            (missing[0], f"missing: with program: give all of model, data and train (the integrations' gates "
                         f"read them) or none of them (got {', '.join(partial)})")]
    if "program" in raw:
        return problems
    hint = " (or pilot your own training program with program.command instead)"
    return [(p[0], p[1] + hint) if p[0] in PROGRAM_OPTIONAL and Problem.kind_of(p) is ProblemKind.MISSING else p
            for p in problems]


# pilot.resume.before: auto for pilotrun's own loop (any update is one it can save after; the hash it always had).
LOOP_RESUME_BEFORE = 2


def spec_from_mapping(raw: dict, source: str | Path, overridden: Sequence[str] = (), check_files: bool = True) -> Spec:
    """Validate a mapping as if it were read from ``source`` (its folder anchors relative paths).

    Child processes (restore, resume) rebuild the exact spec of their parent from its
    written mapping, overrides included."""
    p = Path(source)
    # data.path is required only where data is read: estimate/select/plan need a shape alone. Checked on the
    # mapping so that it is reported together with the schema's problems.
    data = raw.get("data")
    unread: list[tuple[str, str]] = []
    if check_files and isinstance(data, dict) and data.get("task") in SHAPE_ONLY_TASKS:
        unread = [("data.task", f"{data['task']} is a shape for estimate, select and plan only (a described "
                                "program's head): built-in JSONL data is causal-lm or seq-classification; give "
                                "data.factory to pilot it")]
    elif check_files and isinstance(data, dict) and data.get("task") is not None and data.get("path") is None:
        unread = [("data.path", "missing; built-in tasks read JSONL from data.path")]
    program_only = "program" in raw and not any(k in raw for k in PROGRAM_OPTIONAL)
    try:
        spec = build(ProgramOnlySpec if program_only else Spec, copy.deepcopy(raw), str(p))
    except SpecError as exc:
        raise SpecError(_mark_overrides(_schema_problems(exc.problems, raw) + unread, list(overridden)),
                        str(p)) from None
    spec.source = str(p.resolve())
    spec.written = copy.deepcopy(raw)
    if spec.program is None and spec.pilot.resume.before == "auto":
        spec.pilot.resume.before = LOOP_RESUME_BEFORE  # pilotrun's own loop saves wherever the resume gate asks
    if isinstance(spec, ProgramOnlySpec):
        assert spec.program is not None  # ProgramOnlySpec.check refuses `program: null`
        problems = bound_problems(spec, this_machine=False)  # pilot.resume.before/after, seed: as for any spec
        problems += program_file_problems(spec.program, spec.folder) if check_files else []
        if problems:
            raise SpecError(_mark_overrides(problems, list(overridden)), str(p))
        return spec
    spec.model.written, spec.data.written = copy.deepcopy(raw["model"]), copy.deepcopy(raw["data"])
    # ``check_files=False``: estimate/select/plan read no data and no tokenizer, so they need not exist.
    problems = unread + bound_problems(spec, this_machine=check_files)
    problems += spec_problems(spec, data_files=check_files)
    if spec.program is not None and check_files:
        problems += program_file_problems(spec.program, spec.folder)
    if problems:
        raise SpecError(_mark_overrides(problems, list(overridden)), str(p))
    return spec


def _mark_overrides(problems: list[tuple[str, str]], overridden: list[str]) -> list[tuple[str, str]]:
    """Say when the offending value came from --set rather than from the file."""
    out = []
    for f, m in problems:
        if any(f == k or f.startswith((k + ".", k + "[")) or k.startswith(f + ".") for k in overridden if f):
            m = f"{m} (value from --set)"
        out.append((f, m))
    return out
