"""``pilot.yaml`` as one typed object: :class:`Spec` (its sections in :mod:`.sections`) and what is derived from
it — the folder relative paths start from, the canonical config and its hash, and :class:`BuildContext`, what the
building blocks read beyond their own section.

The spec is validated at the edge (:func:`pilotrun.config.load.load_spec`), before anything runs; code further in
receives a :class:`Spec` and never re-parses configuration. Keys fixed by the product (``name``, ``seed``,
``model.*``, ``data.*``, ``train.*``, ``eval.*``) keep their documented meaning; ``pilot.*`` holds what only the
pilot needs.

Example::

    spec = load_spec("examples/tiny-sft/pilot.yaml")
    spec.train.micro_batch_size, spec.resolve(spec.data.path), spec.config_hash()
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path

from .hub_cache import TokenizerSource
from .ids import name_problem
from .paths import resolve_path
from .program import ProgramSpec
from .schema import doc
from .sections import (
    DataSpec,
    DistributedSpec,
    EvalSpec,
    ExportSpec,
    ModelSpec,
    PilotSpec,
    Precision,
    TrainSpec,
)


def dotted(config: dict, prefix: str = "") -> dict:
    """A nested mapping as ``{"train.optimizer.lr": 3e-3, ...}``: how specs, locks and variants are compared key by
    key (an empty mapping adds no key)."""
    out: dict = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(dotted(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def canonical_sha256(config: object) -> str:
    """The config hash: sha256 of the JSON with sorted keys and no spaces (what a checkpoint's config.json, written
    from ``canonical()``, must hash back to)."""
    return hashlib.sha256(json.dumps(config, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@dataclass(frozen=True)
class BuildContext:
    """What the building blocks (``models/``, ``data/``) read from a spec beyond the section they build from."""

    folder: Path  # the spec file's folder: relative paths and factory modules are found from here
    seed: int  # seeds random initialisation and the split by group
    precision: Precision  # train.precision: bf16-true holds the model's weights in bf16
    activation_checkpointing: bool | str  # train.activation_checkpointing (sections.ac_policy reads it)
    task: str | None  # data.task: with a Hugging Face model it picks the head (None: the data's label_names do)
    factory_timeout: float | None = None  # pilot.factory_timeout: seconds a factory's import and call may take


class JobKind(str, Enum):
    """What runs a spec's updates: decided here once (:attr:`Spec.kind`); each layer takes the objects that differ
    from one table keyed by it (drivers.build.DRIVERS, campaign.kinds.KINDS), as Fabric's connector decides its
    variant once."""

    LOOP = "loop"        # pilotrun's own loop over the spec's model, data and train sections
    PROGRAM = "program"  # the user's own program (program: in the spec), which pilotrun starts and watches

    def __str__(self) -> str:
        return self.value


@dataclass
class Spec:
    name: str = doc("job name, used in run ids, folders under --out and the ledger: 1 to 81 letters, digits, . _ - "
                    "(no path separator, no '..')")
    model: ModelSpec = doc("what to train (optional with program:)")
    data: DataSpec = doc("what to train on (optional with program:)")
    train: TrainSpec = doc("how the long run trains (optional with program:)")
    seed: int = doc("seed for python, numpy, torch and the data order", 0)
    eval: EvalSpec = doc("evaluation sizes", EvalSpec)
    pilot: PilotSpec = doc("what the pilot itself runs", PilotSpec)
    distributed: DistributedSpec = doc("how several processes share the job", DistributedSpec)
    export: ExportSpec = doc("what the export gate writes", ExportSpec)
    program: ProgramSpec | None = doc(
        "pilot your own training program instead of factories (README, \"Pilot your own program\"); "
        "model, data and train then become optional", None)

    # Set by load_spec, not by the user.
    source: str = field(default="", init=False, metadata={"internal": True})
    # The YAML as written (+ --set).
    written: dict = field(default_factory=dict, init=False, metadata={"internal": True})
    # For the job a program described (estimate/program_job.py): the program spec's config hash, under which its
    # pilots are recorded. Empty: this spec's own.
    piloted_as: str = field(default="", init=False, metadata={"internal": True})

    @property
    def kind(self) -> JobKind:
        """The one place that decides whether pilotrun's loop or the user's program runs this spec."""
        return JobKind.PROGRAM if self.program is not None else JobKind.LOOP

    def check(self):
        if (why := name_problem(self.name)) is not None:
            yield "name", why
        quant = self.model.quantization
        if quant is not None and quant.bits == 4 and self.train.precision == "fp16":
            yield "train.precision", ("fp16 with a 4-bit base: the base's weights are dequantised into fp16 too, and "
                                      "the activations of bases pretrained in bf16 exceed fp16's range (65504); the "
                                      "grad scaler then skips those updates without failing. Use bf16 or bf16-true "
                                      "(or fp32 with quantization.compute_dtype: fp32 where bf16 is missing)")
        if quant is not None and quant.bits == 8 and (quant.type != "nf4" or not quant.double_quant):
            yield "model.quantization", "type and double_quant apply to bits: 4 only; remove them for bits: 8"
        if self.export.merge and self.model.adapter is None:
            yield "export.merge", "merges an adapter into its base; it needs model.adapter (or remove it)"

    @property
    def folder(self) -> Path:
        return Path(self.source).resolve().parent if self.source else Path.cwd()

    def resolve(self, path: str) -> Path:
        """A path from the spec, relative to the spec file's folder; 'pkg:' paths inside packages."""
        return resolve_path(path, self.folder)

    @property
    def eval_batch_size(self) -> int:
        return self.eval.batch_size or self.train.micro_batch_size

    @property
    def eval_max_length(self) -> int | None:
        return self.eval.max_length or self.data.max_length

    def tokenizer_source(self) -> TokenizerSource:
        """Where ``model.tokenizer`` is (:meth:`ModelSpec.tokenizer_source` from the spec's folder)."""
        return self.model.tokenizer_source(self.folder)

    def build_context(self) -> BuildContext:
        """What ``build_model``, ``load_tokenizer`` and ``build_data`` read besides their own section."""
        return BuildContext(self.folder, self.seed, self.train.precision, self.train.activation_checkpointing,
                            self.data.task, self.pilot.factory_timeout)

    def record(self) -> dict:
        """What a child process rebuilds this exact spec from (``load.spec_from_mapping(written, source)``)."""
        return {"source": self.source, "written": self.written}

    def canonical(self) -> dict:
        """The config with every default filled in, as plain JSON types, for hashing and the lock."""
        out = asdict(self)
        out.pop("source", None)
        out.pop("written", None)
        out.pop("piloted_as", None)
        if out.get("program") is None:  # absent, not null: specs without it keep the hash they always had
            out.pop("program", None)
            out["pilot"]["resume"].pop("auto_within", None)  # a program's key: the loop's hash stays as it was
        else:
            if out["pilot"]["resume"].get("before") != "auto":
                out["pilot"]["resume"].pop("auto_within", None)  # read only with auto: a numbered spec's hash stays
            if not out["program"].get("env"):
                out["program"].pop("env", None)  # no environment of its own: the hash it always had
        out["pilot"].pop("factory_timeout", None)  # how long pilotrun waits, not what runs: the hash stays as it was
        out["pilot"].pop("variants", None)  # what `pilotrun variants` compares, not the job: the hash stays too
        if isinstance(out.get("train"), dict) and out["train"].get("precision") != "fp8":
            out["train"].pop("fp8_recipe", None)  # read only under fp8: every other spec keeps the hash it had
        if isinstance(out.get("train"), dict) and out["train"].get("compile") == "off":
            out["train"].pop("compile", None)  # eager, the default: specs without it keep the hash they had
        if out["model"].get("moe") is None:
            out["model"].pop("moe", None)  # absent, not null: specs without it keep the hash they always had
        for section in ("model", "data"):
            out[section].pop("written", None)  # the loader's copy of the mapping, not a key (an extra may be one)
            extra = out[section].pop("extra", {}) or {}
            out[section].update(extra)
        return json.loads(json.dumps(out, sort_keys=True, default=list))

    def config_hash(self) -> str:
        return canonical_sha256(self.canonical())

    def pilot_hash(self) -> str:
        """The config hash a pilot of this job is recorded under: what the estimate's ledger lookups (measured
        utilisation, stage times, variants, the proven lock) ask for. A program's pilot is recorded under its
        program spec's hash, not under the hash of the job the program described."""
        return self.piloted_as or self.config_hash()


# Sections a program spec may leave out: the program builds its own model, data and training loop.
PROGRAM_OPTIONAL = ("model", "data", "train")


@dataclass
class ProgramOnlySpec(Spec):
    """A spec with ``program:`` and without model/data/train: only ``pilotrun run`` reads it (the program pilot);
    ``model``, ``data`` and ``train`` are None here and nothing on the program path reads them."""

    model: ModelSpec = doc("what to train (optional with program:)", None)
    data: DataSpec = doc("what to train on (optional with program:)", None)
    train: TrainSpec = doc("how the long run trains (optional with program:)", None)

    def check(self):
        if (why := name_problem(self.name)) is not None:
            yield "name", why
        if self.program is None:  # found by the fuzzer: `program: null` alone was an internal error (exit 3)
            yield "program", ("is null: give program.command (the program to pilot), or remove program: and give "
                              "model, data and train")
        given = [k for k in PROGRAM_OPTIONAL if getattr(self, k) is not None]
        if given:  # never reached from load_spec (a complete spec builds Spec); kept for direct builders
            yield given[0], "a program-only spec has no model/data/train; give all three or none"

    def canonical(self) -> dict:
        out = asdict(self)
        for key in ("source", "written", "piloted_as", *PROGRAM_OPTIONAL):
            out.pop(key, None)
        if out.get("program") and not out["program"].get("env"):
            out["program"].pop("env", None)  # no environment of its own: the hash it always had
        out["pilot"].pop("factory_timeout", None)
        out["pilot"].pop("variants", None)
        return json.loads(json.dumps(out, sort_keys=True, default=list))


