"""``pilot.yaml``: every key the pilot reads, declared once with its type and meaning.

The spec is validated here, at the edge, before anything runs; code further in
receives a :class:`Spec` and never re-parses configuration. Keys fixed by the
product (``name``, ``seed``, ``model.*``, ``data.*``, ``train.*``, ``eval.*``) keep
their documented meaning; ``pilot.*`` holds what only the pilot needs.

Example::

    spec = load_spec("examples/tiny-sft/pilot.yaml")
    spec.train.micro_batch_size, spec.resolve(spec.data.path)
"""
from __future__ import annotations

import copy
import hashlib
import importlib
import importlib.util
import json
import re
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from .exitguard import ExitCalled
from .hub_cache import TokenizerNotFound, TokenizerSource, locate_tokenizer
from .limits import bound_problems
from .program import ProgramSpec, program_file_problems
from .schema import SpecError, build, doc
from .strategy_names import ALIASES as STRATEGY_ALIASES
from .strategy_names import DEFAULT as DEFAULT_STRATEGY
from .strategy_names import StrategyName
from .yamlsafe import parse_bounded, parse_override_value, read_spec_text, regular_file_problem

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,80}$")
# A Hub id is "name" or "org/name"; anything with more path parts, or that starts
# like a path, must exist on disk.
HUB_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


# Optimizers whose state lives in bitsandbytes' 8-bit blockwise format (2 bytes per trainable parameter
# plus block statistics); `paged_` pages that state to host memory under pressure (CUDA only).
BNB_OPTIMIZERS = ("adamw8bit", "paged_adamw8bit")


@dataclass
class AdapterSpec:
    """A PEFT adapter trained on a frozen base (LoRA today): only the adapter's matrices get gradients and
    optimizer state, checkpoints hold the adapter alone, and export writes the PEFT artifact."""

    type: Literal["lora"] = doc("adapter kind, built with the peft library", "lora")
    r: int = doc("LoRA rank: each adapted Linear(in, out) gains r*(in+out) trainable parameters", 16)
    alpha: float = doc("LoRA scaling numerator: the update is scaled by alpha / r", 32.0)
    dropout: float = doc("dropout on the adapter's input", 0.05)
    target_modules: list[str] | str = doc(
        "module names to adapt (e.g. [q_proj, v_proj]), or 'all-linear' as PEFT reads it (every Linear but the "
        "output head)", "all-linear")

    def check(self):
        if self.r < 1:
            yield "r", f"must be at least 1, got {self.r}"
        if self.alpha <= 0:
            yield "alpha", f"must be positive, got {self.alpha}"
        if not 0.0 <= self.dropout < 1.0:
            yield "dropout", f"must be in [0, 1), got {self.dropout}"
        if isinstance(self.target_modules, str) and self.target_modules != "all-linear":
            yield "target_modules", (f"expected a list of module names or 'all-linear', got {self.target_modules!r}")
        if isinstance(self.target_modules, list) and not self.target_modules:
            yield "target_modules", "is empty; name the modules to adapt (e.g. [q_proj, v_proj]) or use all-linear"


@dataclass
class QuantizationSpec:
    """A quantised frozen base through transformers' BitsAndBytesConfig (bitsandbytes). With model.adapter this
    is QLoRA; a quantised base alone cannot be trained."""

    bits: Literal[4, 8] = doc("4 (Linear4bit, packed two weights per byte) or 8 (LLM.int8 Linear8bitLt)")
    type: Literal["nf4", "fp4"] = doc("4-bit data type (bits: 4 only)", "nf4")
    double_quant: bool = doc("quantise the 4-bit blocks' scales too (about 0.37 bits per weight saved)", True)
    compute_dtype: Literal["bf16", "fp16", "fp32"] = doc("dtype the 4-bit weights are dequantised to for matmuls",
                                                          "bf16")


@dataclass
class ExportSpec:
    merge: bool = doc("with model.adapter, also export the base with the adapter merged in (a plain model folder)",
                      False)


@dataclass
class ModelSpec:
    factory: str | None = doc(
        '"module:function" called with this mapping; returns an nn.Module whose forward(**batch) returns .loss', None)
    hf: str | None = doc(
        "Hugging Face model: a local folder, 'pkg:PACKAGE/sub/folder' inside an installed package, or a Hub id", None)
    revision: str | None = doc("Hub commit for model.hf (a 40-hex commit pins it; a branch name does not)", None)
    config: dict[str, Any] | None = doc(
        "a transformers config mapping with model_type; the model is built from it with random weights", None)
    tokenizer: str | None = doc("tokenizer folder, tokenizer.json, or a Hub id already in the local Hugging Face "
                                "cache (never downloaded) for built-in tasks (defaults to model.hf)", None)
    trust_remote_code: bool = doc("let transformers run model code shipped with model.hf", False)
    adapter: AdapterSpec | None = doc("train a LoRA adapter on the frozen model instead of every weight", None)
    quantization: QuantizationSpec | None = doc(
        "load the frozen base quantised to 4 or 8 bits with bitsandbytes (needs model.hf or model.config)", None)
    extra: dict[str, Any] = field(default_factory=dict)  # factory arguments

    @staticmethod
    def allow_extra(data: dict) -> bool:
        # The factory receives the whole mapping, so its own keys are legitimate.
        return isinstance(data, dict) and data.get("factory") is not None

    def check(self):
        chosen = [k for k in ("factory", "hf", "config") if getattr(self, k) is not None]
        if len(chosen) != 1:
            yield "", (
                "give exactly one of model.factory, model.hf or model.config"
                + (f" (got {', '.join(chosen)})" if chosen else "")
            )
        if self.factory is not None and not re.match(r"^[\w.]+:[\w.]+$", self.factory):
            yield "factory", f"expected 'module:function', got {self.factory!r}"
        if self.config is not None and "model_type" not in self.config:
            yield "config", "needs a model_type (e.g. llama, bert) so transformers knows which architecture to build"
        if self.revision is not None and self.hf is None:
            yield "revision", "only applies to model.hf"
        if self.quantization is not None:
            if self.factory is not None:
                yield "quantization", ("applies to transformers models (model.hf or model.config); quantise inside "
                                       "your factory instead")
            if self.adapter is None:
                yield "quantization", ("a quantised base cannot be trained: its weights are frozen integers; add "
                                       "model.adapter (LoRA on a 4-bit base is QLoRA) or remove model.quantization")


@dataclass
class DataSpec:
    factory: str | None = doc(
        '"module:function" called with this mapping; returns {"train", "val", "collate", ...} '
        '(README, "Your own model and data")', None)
    task: Literal["causal-lm", "seq-classification"] | None = doc("built-in task on JSONL data", None)
    path: str | dict[str, str] | None = doc(
        "JSONL file (split by group) or {train: file, val: file[, test: file]}", None)
    max_length: int | None = doc("tokens per training example after truncation (the length the long run uses)", None)
    val_fraction: float = doc(
        "share of groups held out for validation when the data is one file (or a factory's 'all')", 0.1)
    test_fraction: float = doc("share of groups held out for test, the same way", 0.0)
    labels: list[str] | None = doc(
        "class names in index order for seq-classification (default: sorted names found in the data)", None)
    num_workers: int = doc("DataLoader worker processes", 0)
    drop_last: bool = doc("drop an epoch's last partial micro batch", False)
    extra: dict[str, Any] = field(default_factory=dict)  # factory arguments

    @staticmethod
    def allow_extra(data: dict) -> bool:
        return isinstance(data, dict) and data.get("factory") is not None

    def check(self):
        if (self.factory is None) == (self.task is None):
            yield "", "give exactly one of data.factory or data.task (causal-lm | seq-classification)"
        if self.factory is not None and not re.match(r"^[\w.]+:[\w.]+$", self.factory):
            yield "factory", f"expected 'module:function', got {self.factory!r}"
        if self.task is not None:
            # data.path is required only where data is read (_check_files): estimate/select/plan need a shape only.
            if self.max_length is None:
                yield "max_length", "missing; built-in tasks truncate to data.max_length"
        if isinstance(self.path, dict):
            unknown = set(self.path) - {"train", "val", "test"}
            if unknown:
                yield "path", f"unknown split(s) {sorted(unknown)}; use train, val and optionally test"
            for need in ("train", "val"):
                if need not in self.path:
                    yield f"path.{need}", "missing; a split mapping needs train and val"
        if self.max_length is not None and self.max_length < 2:
            yield "max_length", (f"must be at least 2, got {self.max_length} (leave it out when the inputs have no "
                                 "sequence, e.g. images or feature vectors)")
        if not 0.0 < self.val_fraction < 1.0:
            yield "val_fraction", f"must be between 0 and 1 (exclusive), got {self.val_fraction}"
        if not 0.0 <= self.test_fraction < 1.0 or self.val_fraction + self.test_fraction >= 1.0:
            yield "test_fraction", (f"must be 0 or more and leave groups for training (val + test < 1), "
                                    f"got {self.test_fraction}")
        if self.num_workers < 0:
            yield "num_workers", "must be 0 or more"


@dataclass
class OptimizerSpec:
    lr: float = doc("peak learning rate")
    name: Literal["adamw", "sgd", "adamw8bit", "paged_adamw8bit", "adafactor"] = doc(
        "adamw (torch), sgd, adamw8bit / paged_adamw8bit (bitsandbytes 8-bit state), adafactor (transformers, "
        "factored second moment, no first moment)", "adamw")
    fused: Literal["auto", True, False] = doc(
        "AdamW's fused kernel: auto uses it where torch has one for the device and dtype, true requires it", "auto")
    weight_decay: float = doc("decoupled weight decay (not applied to biases and norm weights)", 0.0)
    betas: tuple[float, float] = doc("AdamW betas", (0.9, 0.999))
    eps: float = doc("AdamW epsilon", 1e-8)
    momentum: float = doc("SGD momentum", 0.0)

    def check(self):
        if self.lr <= 0:
            yield "lr", f"must be positive, got {self.lr}"
        if self.weight_decay < 0:
            yield "weight_decay", "must be 0 or more"
        if self.fused is True and self.name != "adamw":
            yield "fused", f"applies to adamw only (optimizer.name is {self.name!r}); remove it or use adamw"


@dataclass
class SchedulerSpec:
    name: Literal["constant", "cosine", "linear"] = doc("learning-rate shape after warm-up", "constant")
    warmup_updates: int = doc("linear warm-up from 0 over this many updates", 0)
    min_lr_ratio: float = doc("final lr as a fraction of optimizer.lr (cosine, linear)", 0.0)

    @staticmethod
    def normalize(data: Any) -> Any:
        return {"name": data} if isinstance(data, str) else data

    def check(self):
        if self.warmup_updates < 0:
            yield "warmup_updates", "must be 0 or more"
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            yield "min_lr_ratio", "must be between 0 and 1"


@dataclass
class TrainSpec:
    micro_batch_size: int = doc("examples per forward/backward on one device")
    updates: int = doc(
        "optimizer updates of the real run; sizes the lr schedule (the pilot runs pilot.updates of them)")
    optimizer: OptimizerSpec = doc("optimizer and its hyper-parameters")
    grad_accum_steps: int = doc("micro batches accumulated per optimizer update", 1)
    precision: Literal["fp32", "bf16", "fp16", "bf16-true"] = doc(
        "fp32; bf16 autocast over fp32 weights; fp16 autocast with a grad scaler; bf16-true: weights, gradients and "
        "optimizer state held in bf16, no autocast (torch_dtype=bfloat16 fine-tuning)", "fp32")
    scheduler: SchedulerSpec = doc("learning-rate schedule (a name or a mapping)", SchedulerSpec)
    max_grad_norm: float | None = doc("clip the global gradient norm to this (null: measure, do not clip)", 1.0)
    activation_checkpointing: bool = doc("recompute activations in backward (Hugging Face models)", False)
    device: str = doc("auto (first accelerator, else CPU), cpu, cuda, cuda:N or mps", "auto")
    shuffle: bool = doc("shuffle the training set each epoch (seeded)", True)
    loss_normalization: Literal["auto", "per_micro_batch"] = doc(
        "auto: token-exact accumulation via num_items_in_batch when the model accepts it; per_micro_batch: "
        "declare on purpose that each micro batch's own mean is averaged (accum_equivalence then only reports)", "auto")

    def check(self):
        for name in ("micro_batch_size", "grad_accum_steps", "updates"):
            value = getattr(self, name)
            if isinstance(value, int) and value < 1:
                yield name, f"must be at least 1, got {value}"
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            yield "max_grad_norm", "must be positive, or null to disable clipping"
        if not re.match(r"^(auto|cpu|mps|cuda(:\d+)?)$", self.device):
            yield "device", f"expected auto, cpu, cuda, cuda:N or mps, got {self.device!r}"


@dataclass
class EvalSpec:
    batch_size: int | None = doc("evaluation batch size (default: train.micro_batch_size)", None)
    max_length: int | None = doc(
        "longest evaluation length; the eval gate measures a batch padded to it (default: data.max_length)", None)
    max_batches: int | None = doc("validation batches for the eval metric (null: the whole split)", 20)

    def check(self):
        for name in ("batch_size", "max_length", "max_batches"):
            value = getattr(self, name)
            if value is not None and value < 1:
                yield name, f"must be at least 1, got {value}"


@dataclass
class InspectSpec:
    examples: int = doc("examples shown by the inspect gate (and pilotrun inspect -n)", 3)
    max_unsupervised_share: float = doc(
        "fail when more than this share of training examples has no supervised label left after truncation "
        "(any at all warns)", 0.05)

    def check(self):
        if self.examples < 0:
            yield "examples", "must be 0 or more"
        if not 0.0 <= self.max_unsupervised_share <= 1.0:
            yield "max_unsupervised_share", "must be between 0 and 1"


@dataclass
class OverfitSpec:
    examples: int = doc("training examples in the subset the model must learn", 8)
    max_updates: int = doc("update budget; stops early once both thresholds are met", 200)
    micro_batch_size: int = doc("examples per update, drawn in a new order each pass (not one fixed batch)", 4)
    loss_below: float | None = doc(
        "pass when the subset's loss falls below this (default: a tenth of its loss before training)", None)
    accuracy_at_least: float = doc("pass when at least this share of the subset's own targets is predicted", 0.95)
    check_every: int = doc("updates between checks of loss and accuracy", 10)

    def check(self):
        for name in ("examples", "max_updates", "micro_batch_size", "check_every"):
            if getattr(self, name) < 1:
                yield name, "must be at least 1"
        if not 0.0 <= self.accuracy_at_least <= 1.0:
            yield "accuracy_at_least", "must be between 0 and 1"


@dataclass
class ResumeSpec:
    before: int = doc("updates the interrupted process runs before it saves and is killed", 2)
    after: int = doc("updates the restored process runs; compared with the control run's", 2)
    rtol: float = doc(
        "relative tolerance for loss and gradient norm off CPU or in bf16/fp16 (CPU fp32 is bitwise)", 1e-3)

    def check(self):
        if self.before < 1 or self.after < 1:
            yield "", "before and after must be at least 1"
        if self.rtol < 0:
            yield "rtol", "must be 0 or more"


@dataclass
class PilotSpec:
    updates: int = doc("updates the pilot runs: the first (first_step) and the rest (steady_step)", 6)
    gates: list[str] | None = doc("gates to run (default: all, in order)", None)
    inspect: InspectSpec = doc("the inspect gate", InspectSpec)
    overfit: OverfitSpec = doc("the overfit gate", OverfitSpec)
    resume: ResumeSpec = doc("the resume gate", ResumeSpec)

    def check(self):
        if self.updates < 2:
            yield "updates", f"must be at least 2 (one first_step and at least one steady_step), got {self.updates}"


@dataclass
class DistributedSpec:
    # The registry's names (pilotrun.strategies.STRATEGIES), mirrored in config/strategy_names.py, which the
    # registry checks at its import; an alias (`none`) is read as the name it stands for.
    strategy: StrategyName = doc(
        "single: one process; ddp: a full replica per process, gradients all-reduced; fsdp: FSDP2 fully_shard of "
        "each repeated block and the root (launch with `pilotrun launch --nproc-per-node N` or torchrun)",
        DEFAULT_STRATEGY)

    @staticmethod
    def normalize(data: Any) -> Any:
        # Specs written before the spec, the CLI and the estimator shared one vocabulary said `none`.
        named = data.get("strategy") if isinstance(data, dict) else None
        if isinstance(named, str) and named in STRATEGY_ALIASES:
            return {**data, "strategy": STRATEGY_ALIASES[named]}
        return data


@dataclass
class Spec:
    name: str = doc("job name, used in run ids and the ledger (letters, digits, . _ -)")
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

    def check(self):
        if not NAME_RE.match(self.name):
            yield "name", f"use letters, digits, '.', '_' or '-' (got {self.name!r})"
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
        if path.startswith("pkg:"):
            return resolve_package_path(path)
        p = Path(path).expanduser()
        return p if p.is_absolute() else self.folder / p

    @property
    def eval_batch_size(self) -> int:
        return self.eval.batch_size or self.train.micro_batch_size

    @property
    def eval_max_length(self) -> int | None:
        return self.eval.max_length or self.data.max_length

    def tokenizer_source(self) -> TokenizerSource:
        """Where ``model.tokenizer`` is: a local path, or a Hub id in the local cache (at ``model.revision`` when it
        names model.hf's repo). Raises :class:`TokenizerNotFound`."""
        value = self.model.tokenizer
        assert value is not None
        revision = self.model.revision if value == self.model.hf else None
        return locate_tokenizer(value, self.resolve, revision, hub_id_like=not looks_local(value))

    def canonical(self) -> dict:
        """The config with every default filled in, as plain JSON types, for hashing and the lock."""
        out = asdict(self)
        out.pop("source", None)
        out.pop("written", None)
        if out.get("program") is None:  # absent, not null: specs without it keep the hash they always had
            out.pop("program", None)
        for section in ("model", "data"):
            extra = out[section].pop("extra", {}) or {}
            out[section].update(extra)
        return json.loads(json.dumps(out, sort_keys=True, default=list))

    def config_hash(self) -> str:
        text = json.dumps(self.canonical(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def model_mapping(self) -> dict:
        """What model.factory is called with: the spec's model mapping as the user wrote it (no defaults added)."""
        return copy.deepcopy(self.written.get("model") or {})

    def data_mapping(self) -> dict:
        """What data.factory is called with: the spec's data mapping as written."""
        return copy.deepcopy(self.written.get("data") or {})


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
        if not NAME_RE.match(self.name):
            yield "name", f"use letters, digits, '.', '_' or '-' (got {self.name!r})"
        given = [k for k in PROGRAM_OPTIONAL if getattr(self, k) is not None]
        if given:  # never reached from load_spec (a complete spec builds Spec); kept for direct builders
            yield given[0], "a program-only spec has no model/data/train; give all three or none"

    def canonical(self) -> dict:
        out = asdict(self)
        for key in ("source", "written", *PROGRAM_OPTIONAL):
            out.pop(key, None)
        return json.loads(json.dumps(out, sort_keys=True, default=list))


class ProgramSpecRefused(SpecError):
    """A program-only spec given to a command that needs model/data/train (estimate, select, plan, campaign)."""


def resolve_package_path(path: str) -> Path:
    """'pkg:NAME/sub/dir' → that folder inside the installed package NAME."""
    name, _, rest = path[len("pkg:"):].partition("/")
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {name!r} is not installed (pip install it, or give a folder)")
    return Path(list(spec.submodule_search_locations)[0]) / rest


def looks_local(value: str) -> bool:
    return value.startswith(("pkg:", ".", "/", "~")) or not HUB_ID_RE.match(value)


class ShadowedModule(ImportError):
    """A module beside the spec has the name of a module Python already imported from elsewhere."""


_FACTORY_MODULES: dict[str, Path] = {}  # top-level module name -> spec folder it was imported from


def _import_factory(target: str, folder: Path) -> Any:
    module_name, _, func_name = target.partition(":")
    top = module_name.split(".")[0]
    previous = _FACTORY_MODULES.get(top)
    if previous is not None and previous != folder:
        # Another spec's module of the same name (campaigns, tests): import this folder's own.
        for name in [m for m in sys.modules if m == top or m.startswith(top + ".")]:
            del sys.modules[name]
        if str(previous) in sys.path:
            sys.path.remove(str(previous))
    if str(folder) in sys.path:
        sys.path.remove(str(folder))
    sys.path.insert(0, str(folder))
    module = importlib.import_module(module_name)
    local = [folder / f"{top}.py", folder / top / "__init__.py"]
    top_file = getattr(sys.modules.get(top), "__file__", None) or "built-in"
    if any(x.exists() for x in local) and (top_file == "built-in"
                                           or not Path(top_file).resolve().is_relative_to(folder.resolve())):
        raise ShadowedModule(
            f"{top!r} resolved to {top_file}, not to {next(x for x in local if x.exists())}: a module of that name was "
            f"already imported (often the standard library); rename your file"
        )
    _FACTORY_MODULES[top] = folder
    obj = module
    for part in func_name.split("."):
        obj = getattr(obj, part)
    return obj


def import_factory(target: str, folder: Path):
    """Import 'module:function' relative to the spec folder (README, "Your own model and data")."""
    return _import_factory(target, folder)


def _check_model_config(spec: Spec) -> list[tuple[str, str]]:
    """transformers accepts any key into a config and ignores the misspelt ones: a typo would silently
    estimate or train another model. Every key must be a field of that architecture's config."""
    import difflib
    import inspect as _inspect

    cfg = spec.model.config or {}
    model_type = cfg.get("model_type")
    try:
        from transformers import CONFIG_MAPPING, PretrainedConfig
    except ImportError:  # pragma: no cover - transformers is a dependency
        return []
    if not isinstance(model_type, str):
        return [("model.config.model_type", f"expected a string naming an architecture (e.g. 'llama', 'bert'), got "
                 f"{type(model_type).__name__} {str(model_type)[:60]}")]
    if model_type not in CONFIG_MAPPING:
        close = difflib.get_close_matches(str(model_type), list(CONFIG_MAPPING.keys()), n=3)
        hint = f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""
        return [("model.config.model_type", f"unknown architecture {model_type!r}{hint}")]
    cls = CONFIG_MAPPING[model_type]
    known = set(_inspect.signature(cls.__init__).parameters) | set(PretrainedConfig().to_dict())
    try:
        known |= set(cls().to_dict())
    except Exception:  # some configs need arguments to build a default
        pass
    known |= set(getattr(cls, "attribute_map", {}) or {})
    problems = []
    for key in cfg:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            problems.append((f"model.config.{key}",
                             f"not a field of {cls.__name__}{hint} (transformers would ignore it)"))
    return problems


def _check_files(spec: Spec, data_files: bool = True) -> list[tuple[str, str]]:
    problems = []
    if spec.model.config is not None:
        problems += _check_model_config(spec)

    def need_file(field_name: str, value: str, kind: str = "file") -> None:
        try:
            p = spec.resolve(value)
        except FileNotFoundError as exc:
            problems.append((field_name, str(exc)))
            return
        if not p.exists():
            problems.append((field_name, f"{kind} not found: {p} (paths are relative to the spec's folder)"))
        elif not p.is_dir() and (not_regular := regular_file_problem(p)) is not None:
            # A FIFO or a device would block or never end when read: refused from stat() alone, never opened.
            problems.append((field_name, f"{not_regular}; give a file or a folder"))
        elif kind == "file" and p.is_dir():
            problems.append((field_name, f"expected a file, got a folder: {p}"))
        elif p.is_file():
            try:
                with open(p, "rb") as fh:
                    fh.read(1)
            except OSError as exc:
                problems.append((field_name, f"cannot read {p}: {exc.strerror}"))

    if isinstance(spec.data.path, str) and data_files:
        need_file("data.path", spec.data.path)
    elif isinstance(spec.data.path, dict) and data_files:
        for split, value in spec.data.path.items():
            need_file(f"data.path.{split}", value)
    if spec.model.hf is not None and looks_local(spec.model.hf):
        need_file("model.hf", spec.model.hf, kind="folder")
    if spec.model.tokenizer is not None and data_files:
        try:
            spec.tokenizer_source()
        except TokenizerNotFound as exc:
            problems.append(("model.tokenizer", str(exc)))
    if spec.data.task is not None and spec.model.factory is None and data_files:
        if spec.model.tokenizer is None and spec.model.hf is None:
            problems.append(("model.tokenizer", "missing; built-in tasks with model.config need a tokenizer folder "
                             "or tokenizer.json"))
    if spec.data.task is not None and spec.model.factory is not None and spec.model.tokenizer is None and data_files:
        problems.append(("model.tokenizer", "missing; built-in tasks tokenize text, so a factory model needs "
                         "model.tokenizer"))
    for section, target in (("model", spec.model.factory), ("data", spec.data.factory)):
        if target is None:
            continue
        try:
            fn = _import_factory(target, spec.folder)
        except ShadowedModule as exc:
            problems.append((f"{section}.factory", str(exc)))
            continue
        except ModuleNotFoundError as exc:
            problems.append((f"{section}.factory", f"cannot import {target!r}: {exc} (modules are imported from "
                             f"{spec.folder})"))
            continue
        except AttributeError:
            mod = sys.modules.get(target.partition(":")[0])
            where = f" ({getattr(mod, '__file__', None) or 'built-in'})" if mod is not None else ""
            problems.append((f"{section}.factory", f"{target!r}: the module{where} has no attribute "
                             f"{target.partition(':')[2]!r}"))
            continue
        except ExitCalled as exc:  # os._exit while importing (cli installs the guard)
            problems.append((f"{section}.factory", f"importing {target!r} called os._exit({exc.code!r}); a factory "
                             "module must not end the process when imported (raise an exception instead)"))
            continue
        except SystemExit as exc:  # the user's module exits while importing
            problems.append((f"{section}.factory", f"importing {target!r} called sys.exit({exc.code!r}); a factory "
                             "module must not exit when imported (raise an exception instead)"))
            continue
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # the user's module raised while importing (any BaseException subclass)
            problems.append((f"{section}.factory", f"importing {target!r} raised {type(exc).__name__}: {exc}"))
            continue
        if not callable(fn):
            problems.append((f"{section}.factory", f"{target!r} is not callable"))
    if spec.train.precision == "bf16" and spec.train.device == "mps":
        problems.append(("train.precision", "bf16 autocast is not supported on mps; use fp16 or fp32"))
    ml, eml = spec.data.max_length, spec.eval.max_length
    if ml is not None and eml is not None and eml < ml:
        problems.append(("eval.max_length", f"{eml} is shorter than data.max_length {ml}; evaluation would not see "
                         "the training length"))
    return problems


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


def load_spec(path: str | Path, overrides: list[str] | None = None, check_files: bool = True,
              allow_program: bool = False) -> Spec:
    """Read, validate and check a spec file; raises :class:`SpecError` (exit 2) on any problem.
    ``check_files=False`` skips the data and tokenizer files (the estimator reads neither). A program-only spec
    (``program:`` without model/data/train, a :class:`ProgramOnlySpec`) is refused unless ``allow_program``."""
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
    overridden = []
    for item in overrides or []:
        key, value = parse_override(item)
        set_dotted(raw, key, value)
        overridden.append(key)
    spec = spec_from_mapping(raw, p, overridden, check_files)
    if isinstance(spec, ProgramOnlySpec) and not allow_program:
        raise ProgramSpecRefused([("program", "this spec pilots a program and has no model/data/train, which this "
                                   "command needs: run it with `pilotrun run`, or add model, data and train")], str(p))
    return spec


def spec_from_mapping(raw: dict, source: str | Path, overridden: Sequence[str] = (), check_files: bool = True) -> Spec:
    """Validate a mapping as if it were read from ``source`` (its folder anchors relative paths).

    Child processes (restore, resume) rebuild the exact spec of their parent from its
    written mapping, overrides included."""
    p = Path(source)
    # data.path is required only where data is read: estimate/select/plan need a shape alone. Checked on the
    # mapping so that it is reported together with the schema's problems.
    data = raw.get("data")
    unread: list[tuple[str, str]] = []
    if check_files and isinstance(data, dict) and data.get("task") is not None and data.get("path") is None:
        unread = [("data.path", "missing; built-in tasks read JSONL from data.path")]
    program_only = "program" in raw and not any(k in raw for k in PROGRAM_OPTIONAL)
    partial = [k for k in PROGRAM_OPTIONAL if k in raw] if "program" in raw and not program_only else []
    try:
        spec = build(ProgramOnlySpec if program_only else Spec, copy.deepcopy(raw), str(p))
    except SpecError as exc:
        problems = exc.problems
        if partial:  # a program spec with some of model/data/train: say the fix, not three "missing" lines
            missing = [k for k in PROGRAM_OPTIONAL if k not in raw]
            problems = [(f, m) for f, m in problems if f not in missing] + [
                (missing[0], f"missing: with program: give all of model, data and train (the integrations' gates "
                             f"read them) or none of them (got {', '.join(partial)})")]
        elif "program" not in raw:
            problems = [(f, m + " (or pilot your own training program with program.command instead)"
                         if f in PROGRAM_OPTIONAL and m.startswith("missing") else m) for f, m in problems]
        raise SpecError(_mark_overrides(problems + unread, list(overridden)), str(p)) from None
    spec.source = str(p.resolve())
    spec.written = copy.deepcopy(raw)
    if isinstance(spec, ProgramOnlySpec):
        assert spec.program is not None
        problems = program_file_problems(spec.program, spec.folder) if check_files else []
        if problems:
            raise SpecError(_mark_overrides(problems, list(overridden)), str(p))
        return spec
    # ``check_files=False``: estimate/select/plan read no data and no tokenizer, so they need not exist.
    problems = unread + bound_problems(spec, this_machine=check_files)
    problems += _check_files(spec, data_files=check_files)
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
