"""A program spec's job for ``estimate``, ``select`` and ``plan``: the shape comes from the program itself.

The program is run once in the ``describe`` role (:class:`~pilotrun.program.env.Role`): it stops where it describes
its job (the transformers and Lightning callbacks at train begin, a bare script at ``job.describe(...)``), before its
first update. Its :class:`~pilotrun.program.describe.JobFacts` become the ``model``, ``data`` and ``train`` sections
of an ordinary spec, which the estimator traces as it traces any spec. What the spec writes in those sections, and
``--set``, overrides the program (the long run's sizes may be larger than the pilot's: ``--set
model.config.num_hidden_layers=32``); every value the estimate uses says whether it came from the program, the spec,
``--set`` or was assumed. Descriptions are cached by the program's command and the hashes of its files.

Example::

    job = load_job("examples/hf-trainer/pilot.yaml", ["data.max_length=2048"])
    job.spec.train.micro_batch_size     # 4, TrainingArguments.per_device_train_batch_size
    [f.line() for f in job.provenance]  # "train.micro_batch_size = 4 (program: ...)"
"""
from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config.load import apply_overrides, read_raw, set_dotted, spec_from_mapping
from ..config.schema import SpecError
from ..config.sections import ATTN_IMPLEMENTATIONS as IMPLEMENTATIONS
from ..config.sections import ac_spec_value
from ..config.spec import PROGRAM_OPTIONAL, ProgramOnlySpec, Spec
from ..ledger.records import TextEnum
from ..lock import installed_distributions, program_lock
from ..models.loading import HF_HEADS, LABELLED_HEADS
from ..program.describe import JobFacts
from ..program.env import Event, Role
from ..safefile import FileKind, FileProblem, WriteFailed, read_json, write_atomic
from .cache import CACHE_ENV, default_dir

FORMAT = 1  # bump when JobFacts' fields change meaning
# Used when the program does not say how many updates it runs: select and plan's totals then say they assumed it.
ASSUMED_UPDATES = 1000
ASSUMED_LR = 1e-4


class Source(TextEnum):
    """Where a value of the estimated job came from."""

    PROGRAM = "program"
    SPEC = "spec"
    SET = "--set"
    ASSUMED = "assumed"


@dataclass
class Fact:
    key: str       # the spec key, e.g. train.micro_batch_size
    value: Any
    source: Source
    why: str = ""  # the program's object or setting it was read from, or why it was assumed

    def line(self, source: bool = True) -> str:
        """``key = value (source: why)``; a config mapping shown by its model_type and size."""
        shown = json.dumps(self.value) if not isinstance(self.value, str) else self.value
        if isinstance(self.value, dict):
            kind = self.value.get("model_type")
            shown = f"{{{kind + ', ' if kind else ''}{len(self.value)} keys}}"
        said = ": ".join(x for x in (str(self.source) if source else "", self.why) if x)
        return f"{self.key} = {shown}" + (f" ({said})" if said else "")

    def to_dict(self) -> dict:
        return {"key": self.key, "value": self.value, "source": str(self.source), "why": self.why}


@dataclass
class ProgramJob:
    """The job a program spec runs, as the estimator traces it."""

    spec: Spec
    program: ProgramOnlySpec
    facts: JobFacts
    provenance: list[Fact] = field(default_factory=list)
    described: str = ""   # how the description was obtained (a run of the program, or the cache)

    def to_dict(self) -> dict:
        return {"described": self.described, "framework": self.facts.framework,
                "model_class": self.facts.model_class, "parameters": self.facts.parameters,
                "trainable_parameters": self.facts.trainable_parameters, "world_size": self.facts.world_size,
                "notes": self.facts.notes, "values": [f.to_dict() for f in self.provenance]}


class DescribeCrash(RuntimeError):
    """pilotrun's own code failed inside the program's describe run (a bug in pilotrun): not a DescribeError, so the
    command ends with exit 3 and its traceback saved, never blaming the program or the spec."""


class DescribeError(SpecError):
    """The program could not be described (exit 2, naming the fix)."""


# ---------------------------------------------------------------------------------------------- the facts -> spec


def _program_sections(facts: JobFacts) -> tuple[dict, list[Fact], list[tuple[str, str]]]:
    """The model/data/train mapping the program's facts give, what each value was read from, and the keys the
    program could not give (key, why) that the spec must then give."""
    out: dict = {"model": {}, "data": {}, "train": {"optimizer": {}}}
    facts_out: list[Fact] = []
    missing: list[tuple[str, str]] = []
    fw = facts.framework

    def put(key: str, value: Any, why: str, source: Source = Source.PROGRAM) -> None:
        set_dotted(out, key, value)
        facts_out.append(Fact(key, value, source, why))

    if facts.model_kind == "transformers" and facts.config:
        put("model.config", facts.config, f"{facts.model_class}'s config ({facts.parameters:,} parameters)")
    else:
        missing.append(("model", f"the program's model is {facts.model_class}, not a transformers model: the "
                                 "estimator cannot rebuild it from the program; give model.factory (a function that "
                                 "builds the same model) in the spec"))
    if facts.adapter:
        if facts.adapter.get("unsupported"):
            missing.append(("model.adapter", f"the program trains a {facts.adapter.get('type')} adapter; the "
                                             "estimator traces LoRA only"))
        else:
            put("model.adapter", facts.adapter, "the PEFT model's LoRA config")
    if facts.quantization:
        if "bits" in facts.quantization:
            put("model.quantization", facts.quantization, "the base's quantization_config (bitsandbytes)")
        else:
            missing.append(("model.quantization", f"the base is quantised with {facts.quantization['unsupported']}; "
                                                  "the estimator traces bitsandbytes 4 and 8 bits"))
    _attention(facts, put)
    if facts.head in HF_HEADS:
        put("data.task", facts.head, f"{facts.model_class.rsplit('.', 1)[-1]}'s head")
        labels = _config_labels(facts.config or {})
        if facts.head in LABELLED_HEADS and labels:
            put("data.labels", labels, "the config's id2label")
        if facts.max_length:
            put("data.max_length", facts.max_length, facts.length_source)
        else:
            said = facts.length_source or "not given"
            missing.append(("data.max_length", f"the program's length is unknown ({said}): pass max_length= or batch= "
                                               "to job.describe, or --set data.max_length=N"))
    else:
        missing.append(("data", f"the estimator synthesises batches for {', '.join(HF_HEADS)} models; the "
                                f"program's model {facts.model_class} has another head: give data.factory in the "
                                "spec"))
    for key, value, why in (("micro_batch_size", facts.micro_batch_size, f"{fw}: examples per device"),
                            ("grad_accum_steps", facts.grad_accum_steps, f"{fw}: micro batches per update"),
                            ("updates", facts.updates, f"{fw}: the updates it will run")):
        if value is not None:
            put(f"train.{key}", value, why)
    if facts.micro_batch_size is None:
        missing.append(("train.micro_batch_size", "the program did not say its micro batch: pass batch= or micro_"
                                                  "batch_size= to job.describe, or --set train.micro_batch_size=N"))
    if facts.grad_accum_steps is None:
        put("train.grad_accum_steps", 1, "the program did not say (grad_accum_steps= to job.describe)", Source.ASSUMED)
    if facts.updates is None:
        put("train.updates", ASSUMED_UPDATES, "the program did not say (updates= to job.describe, or --set "
                                              "train.updates=N): totals in select and plan use it", Source.ASSUMED)
    if facts.precision:
        put("train.precision", facts.precision, facts.precision_source or fw)
    else:
        put("train.precision", "fp32", "the program did not say (precision= to job.describe)", Source.ASSUMED)
    if facts.activation_checkpointing is not None:
        policy = facts.checkpointing_policy if facts.activation_checkpointing else None
        put("train.activation_checkpointing", ac_spec_value(policy) if policy else bool(facts.activation_checkpointing),
            f"{fw}: gradient checkpointing {'on' if facts.activation_checkpointing else 'off'}"
            + (f" ({facts.checkpointing_source})" if policy else ""))
    if facts.max_grad_norm is not None:
        put("train.max_grad_norm", facts.max_grad_norm, f"{fw}: gradient clipping")
    if facts.compile is not None:
        put("train.compile", facts.compile, f"{fw}: {facts.compile_source or 'torch.compile'}")
    _optimizer(facts, put)
    return out, facts_out, missing


def _config_labels(config: dict) -> list[str] | None:
    """The class names of a described config's id2label in index order; None when it has none or they are not
    indices 0..n-1 (a config as JSON has string keys; one written by hand may have anything)."""
    id2label = config.get("id2label")
    if not isinstance(id2label, dict) or not id2label:
        return None
    try:
        by_index = {int(k): str(v) for k, v in id2label.items()}
    except (TypeError, ValueError):
        return None
    return [by_index[i] for i in range(len(by_index))] if set(by_index) == set(range(len(by_index))) else None


def _attention(facts: JobFacts, put: Callable[..., None]) -> None:
    """The attention kernel of the program's transformers model, which the trace models as the target runs it."""
    if not facts.attn_implementation:
        return
    if facts.attn_implementation in IMPLEMENTATIONS:
        put("model.attn_implementation", facts.attn_implementation, "the model config's _attn_implementation")
    else:   # flex_attention, a kernel hub's: not one the estimator models, said
        put("model.attn_implementation", "sdpa", f"the program's attention is {facts.attn_implementation!r}, which "
            f"the estimator does not model ({', '.join(IMPLEMENTATIONS)}): traced as sdpa's kernel (output + "
            "logsumexp kept); --set model.attn_implementation to choose", Source.ASSUMED)


def _optimizer(facts: JobFacts, put: Callable[..., None]) -> None:
    opt = facts.optimizer
    if not opt:
        put("train.optimizer.name", "adamw", "the program described no optimizer", Source.ASSUMED)
        put("train.optimizer.lr", ASSUMED_LR, "the program described no optimizer", Source.ASSUMED)
        return
    cls = opt["class"]
    if opt.get("name") is None:
        put("train.optimizer.name", "adamw", f"the program's {cls} is not one the estimator traces (adamw, sgd, "
                                             "adamw8bit, paged_adamw8bit, adafactor): its state may differ",
            Source.ASSUMED)
    else:
        put("train.optimizer.name", opt["name"], cls)
    if "lr" in opt and opt["lr"] > 0:
        put("train.optimizer.lr", opt["lr"], f"{cls}'s first parameter group")
    else:
        put("train.optimizer.lr", ASSUMED_LR, f"{cls} holds no positive lr", Source.ASSUMED)
    name = opt.get("name") or "adamw"
    keys = {"adamw": ("weight_decay", "betas", "eps"), "sgd": ("weight_decay", "momentum")}.get(name, ())
    for key in keys:
        if key in opt:
            put(f"train.optimizer.{key}", opt[key], cls)
    if name == "adamw" and opt.get("fused") is not None:
        put("train.optimizer.fused", bool(opt["fused"]), f"{cls}(fused={bool(opt['fused'])})")


# A section's keys of which exactly one names the source: the spec's choice replaces the program's.
EXCLUSIVE = {"model": ("factory", "hf", "config"), "data": ("factory", "task")}


def _merge(program: dict, written: dict) -> dict:
    """The spec's sections over the program's: mappings merged key by key, except a source the spec names
    (model.factory over the program's config; a config of another model_type replaces it)."""
    out = copy.deepcopy(program)
    for section, keys in EXCLUSIVE.items():
        mine = written.get(section) or {}
        chosen = [k for k in keys if k in mine]
        same_config = (chosen == ["config"] and isinstance(mine["config"], dict)
                       and "config" in out.get(section, {})
                       and mine["config"].get("model_type", out[section]["config"].get("model_type"))
                       == out[section]["config"].get("model_type"))
        if chosen and not same_config:
            for k in keys:
                out.get(section, {}).pop(k, None)
            if section == "data":
                out[section].pop("labels", None)
            if section == "model" and "factory" in chosen:   # the program's transformers attention is not the factory's
                out[section].pop("attn_implementation", None)

    def deep(into: dict, over: dict) -> None:
        for k, v in over.items():
            if isinstance(v, dict) and isinstance(into.get(k), dict):
                deep(into[k], v)
            else:
                into[k] = copy.deepcopy(v)

    deep(out, {k: v for k, v in written.items() if k in PROGRAM_OPTIONAL})
    return out


def _leaves(mapping: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(mapping, dict) and mapping and not prefix.endswith(".extra"):
        out: dict[str, Any] = {}
        for k, v in mapping.items():
            out |= _leaves(v, f"{prefix}.{k}" if prefix else str(k))
        return out
    return {prefix: mapping} if prefix else {}


def _present(mapping: dict, dotted: str) -> bool:
    node: Any = mapping
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def job_spec(raw: dict, source: str | Path, overridden: list[str], facts: JobFacts) -> tuple[Spec, list[Fact]]:
    """The spec the estimator traces for a program: the program's facts under the spec's own model/data/train (and
    ``--set``, already applied to ``raw``). SpecError names what neither the program nor the spec gives."""
    program, provenance, missing = _program_sections(facts)
    written = {k: raw[k] for k in PROGRAM_OPTIONAL if k in raw}
    merged = _merge(program, written)
    given = _leaves(written)

    def gives(key: str) -> bool:
        if key in EXCLUSIVE:  # the model or the data is given by naming its source, not by any key under it
            return any(g == f"{key}.{src}" or g.startswith(f"{key}.{src}.") for src in EXCLUSIVE[key] for g in given)
        return any(g == key or g.startswith(key + ".") for g in given)

    unresolved = [(k, why) for k, why in missing if not gives(k)]
    if unresolved:
        raise DescribeError([(k, why) for k, why in unresolved], str(source))
    # A program value stays unless the spec gave it (or a section above it), or the merge dropped it (a source the
    # spec chose instead: model.factory over the program's config).
    kept = [f for f in provenance if _present(merged, f.key)
            and not any(f.key == g or f.key.startswith(g + ".") for g in given)]
    for key, value in given.items():
        via_set = any(key == o or key.startswith(o + ".") for o in overridden)
        kept.append(Fact(key, value, Source.SET if via_set else Source.SPEC))
    mapping = {k: v for k, v in raw.items() if k not in PROGRAM_OPTIONAL} | merged
    spec = spec_from_mapping(mapping, source, overridden, check_files=False)
    return spec, sorted(kept, key=lambda f: (f.key.split(".")[0] != "model", f.key))


# ---------------------------------------------------------------------------------------------- the describe run


def describe_key(program: ProgramOnlySpec) -> dict:
    """What a description depends on: the command, the content of the program's files, and the environment that
    runs it (the interpreter and every installed distribution: an upgraded transformers or TRL may build another
    job from the same script, e.g. a new default for gradient checkpointing)."""
    assert program.program is not None
    hashed = program_lock(program)["files"]  # the lock's own hashes of the program's files
    return {"format": FORMAT, "command": program.program.words, "folder": str(program.folder), "files": hashed,
            "env": program.program.env or {}, "python": sys.executable, "python_version": platform.python_version(),
            "distributions": _distributions_digest(), "describers": _describers_digest(),
            "launcher_config": _launcher_config()}


def _distributions_digest() -> str:
    """The installed distributions and their versions, as the lock records them, in one digest."""
    listed = json.dumps(installed_distributions(), sort_keys=True)
    return hashlib.sha256(listed.encode()).hexdigest()[:16]


def _launcher_config() -> str | None:
    """``accelerate launch``'s default config (precision, processes) when the command uses it: its sha256."""
    root = Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface")
    path = Path(os.environ.get("ACCELERATE_CONFIG_FILE") or root / "accelerate" / "default_config.yaml")
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


# What runs inside the program in its describe role: the handle, the describer, and every integration (the whole
# package: a program imports the one of its framework, and a new one must count the day it is added).
DESCRIBE_ROOTS = ("pilotrun.program.handle", "pilotrun.program.describe", "pilotrun.integrations")


def _module_file(package: Path, module: str) -> Path | None:
    """The file of ``pilotrun.a.b`` under ``package`` (the ``pilotrun`` folder): ``a/b.py`` or ``a/b/__init__.py``."""
    base = package.joinpath(*module.split(".")[1:])
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _imported(package: Path, module: str, path: Path) -> set[str]:
    """The pilotrun modules ``path`` imports, lazy ones (inside functions) included: they run in the describe role."""
    import ast

    found: set[str] = set()
    here = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_bytes())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "pilotrun"}
        elif isinstance(node, ast.ImportFrom):
            parts = here[: len(here) - node.level + 1] if node.level else []
            target = ".".join(parts + ([node.module] if node.module else []))
            if target.split(".")[0] != "pilotrun":
                continue
            found.add(target)
            found |= {f"{target}.{a.name}" for a in node.names if _module_file(package, f"{target}.{a.name}")}
    # Importing pilotrun.a.b runs the __init__ of pilotrun and pilotrun.a first.
    return found | {".".join(m.split(".")[:i]) for m in found for i in range(1, len(m.split(".")))}


def describer_sources(package: Path | None = None) -> list[Path]:
    """Every pilotrun source file the describe role can run: :data:`DESCRIBE_ROOTS` (a package with every module
    under it) and, transitively, what they import. Derived from the code, so a module added to that path is in the
    describe cache's key without anyone listing it."""
    package = package or Path(__file__).resolve().parents[1]
    # Parsing ~120 modules takes most of a second: parsed again only when a source file changed.
    stamp = tuple((str(p), p.stat().st_mtime_ns, p.stat().st_size) for p in sorted(package.rglob("*.py")))
    return list(_closure(package, stamp))


@functools.lru_cache(maxsize=4)
def _closure(package: Path, stamp: tuple) -> tuple[Path, ...]:
    todo = [r for r in DESCRIBE_ROOTS if _module_file(package, r)]
    for root in DESCRIBE_ROOTS:
        folder = package.joinpath(*root.split(".")[1:])
        if folder.is_dir():
            todo += [".".join((root, *p.relative_to(folder).with_suffix("").parts)).removesuffix(".__init__")
                     for p in folder.rglob("*.py")]
    seen: dict[str, Path] = {}
    while todo:
        module = todo.pop()
        path = _module_file(package, module)
        if module in seen or path is None:
            continue
        seen[module] = path
        todo += sorted(_imported(package, module, path) - set(seen))
    return tuple(sorted(set(seen.values())))


def _describers_digest(package: Path | None = None) -> str:
    """pilotrun's own code that reads the program's objects (:func:`describer_sources`): a changed describer, an
    upgraded pilotrun or a new integration describes again."""
    package = package or Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in describer_sources(package):
        h.update(path.relative_to(package).as_posix().encode() + b"\0")
        with contextlib.suppress(OSError):
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _cache_dir() -> Path:
    return default_dir().parent / "describe"


def _cache_path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return _cache_dir() / f"{digest}.json"


def _cached(key: dict) -> tuple[JobFacts | None, str]:
    path = _cache_path(key)
    try:
        entry = read_json(path, 4 << 20, {"key": dict, "facts": dict, "described_at": str})
    except FileProblem as exc:
        return None, "" if exc.kind == FileKind.MISSING else f"the cached description {path} is unreadable: described "\
                                                              "again"
    if entry["key"] != key:
        return None, f"the cached description {path} is another program's: described again"
    try:
        return JobFacts.from_dict(entry["facts"]), (f"the job's description cached at {entry['described_at']} "
                                                    f"({path}; --no-trace-cache describes it again)")
    except ValueError as exc:
        return None, f"the cached description {path} is unusable ({exc}): described again"


def _store(key: dict, facts: JobFacts) -> str:
    path = _cache_path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps({"key": key, "facts": facts.to_dict(),
                                       "described_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}))
    except (OSError, WriteFailed) as exc:
        return f"; not cached: {path.parent}: {exc} (set {CACHE_ENV} to a writable folder)"
    return f", cached as {path}"


def run_describe(program: ProgramOnlySpec, key: dict) -> tuple[JobFacts, str]:
    """Run the program in the describe role and read rank 0's description; DescribeError naming the fix."""
    from ..program.runner import RunPlan, run_program

    assert program.program is not None
    work = Path(tempfile.mkdtemp(prefix="pilotrun-describe-"))
    try:
        outcome = run_program(program.program, program.folder, RunPlan(Role.DESCRIBE), work, "describe",
                              work / "ledger.sqlite")
        events = outcome.events.get(0, [])
        described = [e for e in events if e.get("kind") == Event.DESCRIBE]
        problems = [e for e in events if e.get("kind") == Event.PROBLEM]
        if described:
            try:
                return JobFacts.from_dict(described[-1].get("facts") or {}), f"{outcome.seconds:.1f} s"
            except ValueError as exc:
                raise DescribeError([("program", f"the program's description is unusable: {exc}")],
                                    program.source) from None
        crashed = next((p for p in problems if p.get("internal")), None)
        if crashed is not None:
            kept = _keep_log(outcome.log, key, str(crashed.get("traceback") or ""))
            raise DescribeCrash(f"pilotrun's own code failed while describing the job inside the program (a bug in "
                                f"pilotrun, not in the program or the spec): {crashed.get('problem')} (traceback and "
                                f"log: {kept})")
        if problems:
            why = "; ".join(str(p.get("problem")) for p in problems[:3])
        elif not events:
            why = (f"it never called pilotrun.program() ({outcome.how_it_ended()}): add `job = pilotrun.program()` "
                   "and job.describe(model, optimizer, batch=..., max_length=...) before the first update")
        else:
            why = (f"it {outcome.how_it_ended()} without describing its job: call job.describe(model, optimizer, "
                   "batch=..., max_length=...) before the first update, or train through the transformers or Lightning "
                   "callback, which describes it at train begin")
        raise DescribeError([("program", f"describing the job by running {' '.join(program.program.words)}: {why} "
                                         f"(log: {_keep_log(outcome.log, key)})")], program.source)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _keep_log(log: Path, key: dict, traceback: str = "") -> str:
    """The describe run's log (and a traceback pilotrun's code raised in it), kept beside the cache entry it would
    have been: the run's folder is removed."""
    try:
        dest = _cache_path(key).with_suffix(".log")
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(log, dest)
        if traceback:
            with open(dest, "a", encoding="utf-8") as fh:
                fh.write(f"\n--- pilotrun's traceback in the program ---\n{traceback}\n")
        return str(dest)
    except OSError:
        return "not kept"


def describe_program(program: ProgramOnlySpec, refresh: bool = False) -> tuple[JobFacts, str]:
    """The program's facts, from the cache unless ``refresh``, and a line saying how they were obtained."""
    key = describe_key(program)
    note = ""
    if not refresh:
        hit, note = _cached(key)
        if hit is not None:
            return hit, note
    facts, took = run_describe(program, key)
    assert program.program is not None
    return facts, (f"{note + '; ' if note else ''}described by running `{' '.join(program.program.words)}` until "
                   f"it described its job ({took}){_store(key, facts)}")


def load_job(path: str | Path, overrides: list[str] | None = None, refresh: bool = False,
             describe: Callable[[ProgramOnlySpec, bool], tuple[JobFacts, str]] = describe_program) -> ProgramJob:
    """A program spec's job: the program described (or its cached description), then the spec over it."""
    raw, p = read_raw(path)
    as_written = copy.deepcopy(raw)
    overridden = apply_overrides(raw, overrides or [])
    program_part = {k: v for k, v in raw.items() if k not in PROGRAM_OPTIONAL}
    program = spec_from_mapping(program_part, p, [o for o in overridden if o.split(".")[0] not in PROGRAM_OPTIONAL])
    assert isinstance(program, ProgramOnlySpec)
    facts, described = describe(program, refresh)
    spec, provenance = job_spec(raw, p, overridden, facts)
    spec.piloted_as = _piloted_as(as_written, p, overrides or [], program)
    return ProgramJob(spec, program, facts, provenance, described)


def _piloted_as(raw: dict, p: Path, overrides: list[str], program: ProgramOnlySpec) -> str:
    """The hash `pilotrun run` records this program's pilots under: the spec file (``raw``, as written) with the
    overrides a pilot takes (not the estimate's own sizes under model/data/train). Its pilots are the ledger's
    measurements of the job."""
    kept = [o for o in overrides if o.partition("=")[0].strip().split(".")[0] not in PROGRAM_OPTIONAL]
    try:
        return spec_from_mapping(raw, p, apply_overrides(raw, kept), check_files=False).config_hash()
    except SpecError:  # a spec only the estimate reads (a partial model/data/train): no pilot runs it as written
        return program.config_hash()


def is_program_spec(path: str | Path) -> bool:
    """Whether the spec's job comes from its program: ``program:`` without all of model, data and train (a spec that
    writes all three is estimated from them, as before, without running the program). Read only to choose the path;
    load_spec reports the file's problems."""
    try:
        raw, _p = read_raw(path)
    except SpecError:
        return False
    return isinstance(raw, dict) and "program" in raw and not all(k in raw for k in PROGRAM_OPTIONAL)
