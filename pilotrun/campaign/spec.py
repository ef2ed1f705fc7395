"""``campaign.yaml``: a control and variants of one key, over seeds, under one budget, declared up front.

Example::

    name: lr-sweep
    base: ../tiny-sft/pilot.yaml            # a pilot spec: model, data, batch, optimizer
    vary:
      train.optimizer.lr: [3.0e-3, 1.0e-3, 1.0e-2]   # the first value is the control
    seeds: [1, 2]
    updates: 60                              # the same update budget for every run
    eval: {every: 20}
    stop: {non_finite: true, divergence: 3.0, budget_minutes: 60}

Every run's spec is the base with the varied key and the seed set — nothing else may differ;
:func:`run_specs` checks that on the canonical configs and names any other key that moved.
"""
from __future__ import annotations

import copy
import hashlib
import json
import shlex
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..config.limits import CAMPAIGN_BOUNDS, int_problem
from ..config.load import set_dotted, spec_from_mapping
from ..config.program import launcher_processes
from ..config.schema import SpecError, build, doc
from ..config.spec import JobKind, Spec, dotted, name_problem
from ..config.yamlsafe import parse_bounded, read_spec_text


@dataclass
class EvalEvery:
    every: int = doc("updates between validation points (and one at the end)", 20)

    def check(self):
        if self.every < 1:
            yield "every", "must be at least 1"


@dataclass
class StopSpec:
    """The stop rules a campaign declares (program.env.StopRules applies them, to a loop's run and a program's)."""

    non_finite: bool = doc("stop a run at the first non-finite loss or gradient norm", True)
    divergence: float | None = doc("stop when the loss exceeds this multiple of the run's first loss", 3.0)
    budget_minutes: float | None = doc(
        "wall-clock budget for the whole campaign; runs not started are recorded as not run", None)

    def check(self):
        if self.divergence is not None and self.divergence <= 1.0:
            yield "divergence", "must be greater than 1 (a multiple of the first loss)"
        if self.budget_minutes is not None and self.budget_minutes <= 0:
            yield "budget_minutes", "must be positive"


@dataclass
class Keep:
    checkpoint: bool = doc("keep each finished run's final training checkpoint (resumable)", True)
    export: bool = doc(
        "keep each finished run's inference artifact (safetensors + config), what `pilotrun archive` packs", True)
    control_set: int = doc("validation examples whose predictions are kept for every run", 16)


# What a program campaign's templates may name: the run's varied value, its seed, the campaign's update budget.
TEMPLATE_FIELDS = ("value", "seed", "updates")


@dataclass
class ProgramTemplate:
    """How a run's varied value and seed reach a program (a base with ``program:``): words appended to its command
    and environment variables, each with ``{value}``, ``{seed}`` or ``{updates}`` filled in."""

    args: list[str] = doc("words appended to program.command, e.g. [--learning_rate, '{value}', --seed, '{seed}']",
                          list)
    env: dict[str, str] = doc("environment variables for each run, e.g. {LR: '{value}'} (added to program.env)", dict)

    def check(self):
        named: set[str] = set()
        for where, text in [*(("args", a) for a in self.args), *((f"env.{k}", v) for k, v in self.env.items())]:
            if not isinstance(text, str):
                yield where, f"must be a string (quote it in YAML), got {type(text).__name__}"
                continue
            try:
                fields = template_fields(text)
            except ValueError as exc:
                yield where, f"{text!r}: {exc}"
                continue
            unknown = [n for n in fields if n not in TEMPLATE_FIELDS]
            if unknown:
                yield where, f"{text!r} names {', '.join(unknown)}; a template may name {', '.join(TEMPLATE_FIELDS)}"
            named |= set(fields)
        if "value" not in named:
            yield "", "no template names {value}: every run would run the same program (e.g. args: [--lr, '{value}'])"

    def names(self, field: str) -> bool:
        """Whether some template fills ``{field}`` in (a valid template: check() passed)."""
        return any(field in template_fields(t) for t in [*self.args, *self.env.values()])

    def fill(self, value: Any, seed: int, updates: int) -> tuple[list[str], dict[str, str]]:
        fields = {"value": _as_text(value), "seed": seed, "updates": updates}
        return [a.format(**fields) for a in self.args], {k: v.format(**fields) for k, v in self.env.items()}


def template_fields(text: str) -> list[str]:
    """The fields a template fills in; ValueError for a template ``str.format`` would refuse or change the value of
    (a conversion such as ``!r`` or a format spec: the value is written as the campaign file gives it)."""
    import string

    try:
        parsed = list(string.Formatter().parse(text))
    except ValueError as exc:
        raise ValueError(f"not a template: {exc} (write {{{{ and }}}} for literal braces)") from None
    fields = []
    for _literal, name, spec, conversion in parsed:
        if name is None:
            continue
        if spec or conversion:
            raise ValueError(f"{{{name}{'!' + conversion if conversion else ''}{':' + spec if spec else ''}}}: write "
                             f"{{{name}}} alone (the value goes in as the campaign file gives it)")
        fields.append(name)
    return fields


def _as_text(value: Any) -> str:
    """A varied value as a program reads it on its command line: a float without YAML's exponent quirks."""
    return repr(value) if isinstance(value, float) else str(value)


@dataclass
class CampaignSpec:
    base: str = doc("the pilot spec every run starts from (relative to this file)")
    vary: dict[str, list[Any]] = doc("one dotted spec key and its values; the first value is the control")
    seeds: list[int] = doc("seeds: every value runs once per seed")
    updates: int = doc("optimizer updates per run (the same budget for every run)")
    name: str | None = doc("campaign name, its folder under --out and its run ids: as a pilot's name, 1 to 81 "
                           "letters, digits, . _ - (default: the file's stem)", None)
    eval: EvalEvery = doc("validation frequency", EvalEvery)
    stop: StopSpec = doc("stop reasons, declared before the start", StopSpec)
    keep: Keep = doc("what each run keeps", Keep)
    program: ProgramTemplate | None = doc(
        "with a program base (program: in the base spec): how each run's value and seed reach the program", None)
    gpus_per_run: int | None = doc(
        "devices per run, one process each. pilotrun's loop (the base's distributed.strategy ddp or fsdp): above 1, "
        "each run is torchrun with that many ranks (gloo on CPU), on its own devices of this machine (local engine) "
        "or in one Ray task holding that many GPUs (CPUs on a CPU-only cluster). A program: the devices its run is "
        "given where its command's launcher does not say how many (python train.py, torchrun --nproc-per-node gpu, "
        "accelerate's config file); a launcher that says (--nproc-per-node 2) must agree. Default: the launcher's "
        "count, else 1", None)
    processes: int = doc("the older name of gpus_per_run, for pilotrun's loop only (give one of the two)", 1)
    source: str = field(default="", init=False, metadata={"internal": True})

    def check(self):
        if self.name is not None and (why := name_problem(self.name)) is not None:
            yield "name", why
        if len(self.vary) != 1:
            yield "vary", f"a campaign varies exactly one key, got {len(self.vary)} ({', '.join(self.vary) or 'none'})"
        for key, values in self.vary.items():
            if len(values) < 2:
                yield f"vary.{key}", "needs the control and at least one variant"
            why = fixed_reason(key)
            if why:
                yield f"vary.{key}", f"cannot be varied: {why}"
            seen = [json.dumps(v, sort_keys=True) for v in values]
            repeated = sorted({v for v in seen if seen.count(v) > 1})
            if repeated:
                yield f"vary.{key}", f"values repeat ({', '.join(repeated)}): each value is one variant"
        if not self.seeds:
            yield "seeds", "needs at least one seed"
        if len(set(self.seeds)) != len(self.seeds):
            yield "seeds", "seeds repeat"
        if self.updates < 1:
            yield "updates", "must be at least 1"
        if self.processes < 1:
            yield "processes", "must be at least 1"
        if self.gpus_per_run is not None and self.gpus_per_run < 1:
            yield "gpus_per_run", "must be at least 1"
        elif self.gpus_per_run is not None and self.processes not in (1, self.gpus_per_run):
            yield "gpus_per_run", (f"{self.gpus_per_run} and processes {self.processes} disagree: processes is the "
                                   "older name of gpus_per_run; give gpus_per_run alone")
        yield from self._bound_problems()

    def _bound_problems(self):
        """The numbers config/limits.py bounds: each seed as a run's seed, the budget as its train.updates."""
        values: dict[str, list[tuple[int | None, int]]] = {
                  "seeds": list(enumerate(self.seeds)), "updates": [(None, self.updates)],
                  "eval.every": [(None, self.eval.every)], "keep.control_set": [(None, self.keep.control_set)]}
        for b in CAMPAIGN_BOUNDS:
            for i, value in values[b.field]:
                if (problem := int_problem(b, value, b.field if i is None else f"{b.field}[{i}]")) is not None:
                    yield problem

    @property
    def kind(self) -> JobKind:
        """Its base's kind (checked equal when the file was read): a program: section goes with a program base."""
        return JobKind.PROGRAM if self.program is not None else JobKind.LOOP

    @property
    def ranks(self) -> int:
        """The processes of one run of pilotrun's loop (a torchrun group above 1); 1 for a program, whose processes
        are its launcher's (:func:`run_size`)."""
        return (self.gpus_per_run or self.processes) if self.program is None else 1

    @property
    def key(self) -> str:
        return next(iter(self.vary))

    @property
    def values(self) -> list:
        return self.vary[self.key]

    @property
    def folder(self) -> Path:
        return Path(self.source).resolve().parent

    def canonical(self) -> dict:
        out = asdict(self)
        out.pop("source", None)
        if out.get("gpus_per_run") is None:
            out.pop("gpus_per_run", None)  # absent, not null: a campaign without it keeps the digest it had
        return json.loads(json.dumps(out, sort_keys=True, default=str))

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.canonical(), sort_keys=True).encode()).hexdigest()


# What a campaign holds fixed (docs/architecture.md, "Contracts": campaigns): the model, the data, the yardstick, the
# examples per update and the update budget. Varying one of them is another experiment, not a variant.
FIXED = (
    ("seed", "seeds are listed under seeds"),
    ("name", "the name does not change a run"),
    ("pilot.", "pilot settings do not change a training run"),
    ("train.updates", "the campaign gives every run the same update budget (updates:)"),
    ("train.micro_batch_size", "examples per update are fixed; a retry may trade micro batch for accumulation"),
    ("train.grad_accum_steps", "examples per update are fixed; a retry may trade micro batch for accumulation"),
    ("train.device", "the device does not change the experiment; a retry may move a run (--set train.device=...)"),
    ("data", "a campaign fixes the data: every run sees the same examples and the same validation set"),
    ("eval", "the validation set and its metric are the yardstick every run is judged by"),
    ("model", "a campaign fixes the model (architecture and weights); compare models in separate campaigns"),
)


def fixed_reason(key: str) -> str | None:
    """Why ``key`` cannot be a campaign's varied key, or None when it can."""
    if key.startswith("model.config.") and "dropout" in key.rsplit(".", 1)[-1]:
        return None  # a regularisation knob of the same architecture: a fair variant
    for prefix, why in FIXED:
        if key == prefix or key.startswith(prefix + ".") or (prefix.endswith(".") and key.startswith(prefix)):
            return why
    return None


def load_campaign(path: str | Path) -> CampaignSpec:
    p = Path(path)
    if not p.exists():
        raise SpecError([("", f"campaign file not found: {p}")], str(p))
    raw = parse_bounded(read_spec_text(p), str(p))  # a regular file; size, depth and aliases bounded as a pilot spec
    if not isinstance(raw, dict):
        raise SpecError([("", f"{p} must be a mapping (base, vary, seeds, updates, ...)")], str(p))
    spec = build(CampaignSpec, raw, str(p))
    spec.source = str(p.resolve())
    if spec.name is None and (why := name_problem(p.stem)) is not None:  # the default: the file's stem
        raise SpecError([("name", f"the file's stem {p.stem!r} is the campaign's name by default: {why}; set name: "
                                  "in the file")], str(p))
    base = spec.folder / spec.base
    if base.is_dir():
        raise SpecError([("base", f"expected a pilot spec file, got a folder: {base} (did you mean "
                                  f"{spec.base.rstrip('/')}/pilot.yaml?)")], str(p))
    if not base.is_file():
        raise SpecError([("base", f"pilot spec not found: {base}")], str(p))
    from ..config.load import load_spec

    try:  # a broken base is the base's fault, not the varied value's
        base_spec = load_spec(base, allow_program=True)
    except SpecError as exc:
        raise SpecError([("base", f"{spec.base} is not a valid pilot spec: " + "; ".join(
            f"{f}: {m}" if f else m for f, m in exc.problems))], str(p)) from None
    if base_spec.program is not None and spec.program is None:
        raise SpecError([("program", f"the base {spec.base} runs a program: say how each run's value and seed reach "
                                     f"it, e.g. program: {{args: [--{spec.key.rsplit('.', 1)[-1]}, '{{value}}', --seed,"
                                     " '{seed}']} (README, \"then run the first campaign\")")], str(p))
    if base_spec.program is None and spec.program is not None:
        raise SpecError([("program", f"the base {spec.base} has no program: (pilotrun's own loop); vary a spec key "
                                     "instead and remove program:")], str(p))
    if spec.program is not None and len(spec.seeds) > 1 and not spec.program.names("seed"):
        raise SpecError([("program", f"seeds {spec.seeds} would run the same program {len(spec.seeds)} times: name "
                                     "{seed} in program.args or program.env")], str(p))
    if spec.program is not None and spec.processes > 1:
        raise SpecError([("processes", "a program starts its own processes (torchrun in program.command): remove "
                                       "processes (gpus_per_run gives its run devices where its launcher does not "
                                       "say how many)")], str(p))
    if base_spec.program is not None and spec.gpus_per_run is not None:
        said = launcher_processes(base_spec.program.words)
        if said is not None and said != spec.gpus_per_run:
            raise SpecError([("gpus_per_run", f"{spec.gpus_per_run}, but the base's program.command starts {said} "
                                              f"process(es) (its launcher's count), one device each: set gpus_per_run"
                                              f": {said} or remove it, or change the launcher's count")], str(p))
    return spec


def campaign_from_stored(canonical: dict, source: str) -> CampaignSpec:
    """The campaign as declared at its start (the ledger's copy), whatever its file says now."""
    spec = build(CampaignSpec, copy.deepcopy(canonical), source)
    spec.source = source
    return spec


# Keys a retry may change without changing the experiment, provided examples per update are held.
RETRY_KEYS = ("train.micro_batch_size", "train.grad_accum_steps", "train.activation_checkpointing",
              "data.num_workers", "train.device")



def base_spec(campaign: CampaignSpec) -> Spec:
    """The campaign's base spec, read and checked: once per campaign; each run's spec starts from its ``written``."""
    from ..config.load import load_spec

    return load_spec(campaign.folder / campaign.base, allow_program=True)


def run_spec(campaign: CampaignSpec, value, seed: int, extra: Sequence[tuple[str, Any]] = (),
             base_written: dict | None = None, check_files: bool = True) -> Spec:
    """The base spec with the varied key, the seed and the campaign's update budget set.

    ``base_written``: the base as written when the campaign started (a retry uses it, so an
    edit to the file since cannot slip into the retry), or as :func:`base_spec` read it once for every run.
    ``check_files=False``: leave out the data and tokenizer files, the same for every run (a campaign holds the
    model and the data fixed) and checked with the base or the control's spec.
    """
    base_path = campaign.folder / campaign.base
    raw = copy.deepcopy(base_written if base_written is not None else base_spec(campaign).written)
    if campaign.program is not None:  # the value and seed go to the program through its command and environment
        if extra:
            raise SpecError([("", f"{', '.join(k for k, _ in extra)}: a program's run takes its sizes from its own "
                                  "arguments; pilotrun cannot change them for a retry")], str(base_path))
        args, env = campaign.program.fill(value, seed, campaign.updates)
        program = raw["program"]
        words = program["command"] if isinstance(program["command"], list) else shlex.split(program["command"])
        program["command"] = [*words, *args]
        program["env"] = {**(program.get("env") or {}), **env}
        raw["seed"] = seed
        return spec_from_mapping(raw, base_path, check_files=False)
    set_dotted(raw, campaign.key, value)
    raw["seed"] = seed
    set_dotted(raw, "train.updates", campaign.updates)  # the schedule spans the campaign's budget
    for key, v in extra:
        set_dotted(raw, key, v)
    return spec_from_mapping(raw, base_path, check_files=check_files)


def with_seed(spec: Spec, seed: int) -> Spec:
    """A run spec of pilotrun's own loop with another seed, without building it again: the seed is one number no
    other key depends on (its range is checked with the campaign's ``seeds``), so the run of the same value with
    another seed is this one with ``seed`` set. The sections are shared, not copied: a planned run's spec is read
    (its written mapping, hash, lock), never changed. A program's run is built per seed: its templates fill it in."""
    assert spec.program is None, "a program's seed is in its command and environment: build it with run_spec"
    out = copy.copy(spec)
    out.seed = seed
    out.written = {**spec.written, "seed": seed}
    return out


def check_only_varied(control: Spec, variant: Spec, allowed: tuple[str, ...]) -> list[str]:
    """Keys (other than ``allowed``) whose values differ between two run specs."""
    a, b = dotted(control.canonical()), dotted(variant.canonical())
    # A key whose value is a mapping (train.scheduler) moves its sub-keys: those are the varied key too.
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k) and k != "seed"
                  and not any(k == x or k.startswith(x + ".") for x in allowed))


def examples_per_update(spec: Spec) -> int | None:
    """None for a program's run: its batch is its own (the program's arguments hold it fixed)."""
    if spec.train is None:
        return None
    return spec.train.micro_batch_size * spec.train.grad_accum_steps


def run_processes(spec: Spec) -> int:
    """The processes one run starts on its machine: a program's launcher count (config/program.py), else 1 (a run
    of pilotrun's loop here; a group of ``processes`` is Ray's, engines/ray.py)."""
    return (launcher_processes(spec.program.words) if spec.program is not None else None) or 1


def run_size(campaign: CampaignSpec, spec: Spec) -> int:
    """The devices one run takes, one process each: pilotrun's loop's ranks (``gpus_per_run``); a program's launcher
    count, else the campaign's ``gpus_per_run`` (the program, or a launcher deciding its own count, uses what it is
    given; counted as one process per device for its share of the cores), else 1."""
    if spec.program is None:
        return campaign.ranks
    return launcher_processes(spec.program.words) or campaign.gpus_per_run or 1


def run_device(spec: Spec) -> str:
    """The device a run asks for: ``train.device``, or ``auto`` for a program (which picks its own)."""
    return spec.train.device if spec.train is not None else "auto"
