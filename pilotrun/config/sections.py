"""The sections of ``pilot.yaml`` (``model``, ``data``, ``train`` ...): every key declared once, with its type,
default and meaning (rendered into docs/spec.md), and the checks that need only the section itself.

Each building block reads the section it builds from (``models.loading.build_model(spec.model, ...)``,
``data.bundle.build_data(spec.data, ...)``, ``train.optim.build_optimizer(model, spec.train.optimizer)``); what
several of them share beyond their section travels in :class:`pilotrun.config.spec.BuildContext`.
"""
from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from .hub_cache import TokenizerSource, locate_tokenizer
from .ids import name_problem
from .paths import bucket_data_problem, is_bucket_uri, looks_local, path_value_problem, resolve_path
from .schema import doc
from .strategy_names import ALIASES as STRATEGY_ALIASES
from .strategy_names import DEFAULT as DEFAULT_STRATEGY
from .strategy_names import OFFLOADING as OFFLOADING_STRATEGIES
from .strategy_names import StrategyName

# Optimizers whose state lives in bitsandbytes' 8-bit blockwise format (2 bytes per trainable parameter
# plus block statistics); `paged_` pages that state to host memory under pressure (CUDA only).
BNB_OPTIMIZERS = ("adamw8bit", "paged_adamw8bit")

Precision = Literal["fp32", "bf16", "fp16", "bf16-true", "bf16-true-autocast", "fp8"]
PRECISIONS: tuple[str, ...] = get_args(Precision)
# The precisions that hold the model's floating-point weights in bf16 (so its gradients and optimizer state too: no
# fp32 master copy). bf16-true-autocast is the Trainer's bf16=True (accelerate's mixed_precision="bf16", Lightning's
# "bf16-mixed") over a model loaded with torch_dtype=bfloat16: the same weights as bf16-true, with autocast over them.
BF16_WEIGHTS: tuple[str, ...] = ("bf16-true", "bf16-true-autocast")
# The dtype torch.autocast runs under each precision (absent: no autocast). fp8 is bf16's setup (fp32 master weights,
# bf16 autocast) with the Linears' matmuls in float8 (torchao's float8 training, train/fp8.py): torchtitan's recipe.
AUTOCAST_DTYPE: dict[str, str] = {"bf16": "bf16", "fp16": "fp16", "bf16-true-autocast": "bf16", "fp8": "bf16"}
# train.compile's values (train/compile.py applies them; estimate/compiled.py models them).
CompileScope = Literal["off", "model", "blocks"]
# train.fp8_recipe's values: torchao's Float8LinearConfig.from_recipe_name names (train/fp8.py says what each does).
Fp8Recipe = Literal["tensorwise", "rowwise"]
# model.attn_implementation's values (models/attention.py says what each keeps on the target).
AttnImplementation = Literal["sdpa", "flash_attention_2", "flash_attention_3", "eager"]
ATTN_IMPLEMENTATIONS: tuple[str, ...] = get_args(AttnImplementation)

# pilot.factory_timeout's default: a factory that tokenizes a large dataset or reads a 70B checkpoint from a network
# disk takes many minutes; half an hour is above that and still ends a factory that loops (found by the fuzzer: an
# import that never returned, and a data factory asked for 2**31 examples, hung the pilot with no answer).
DEFAULT_FACTORY_TIMEOUT = 1800.0

# The section as the user wrote it (+ --set), set by the loader: what a factory is called with. Internal: no user
# key, not in the canonical config (config.spec.Spec.canonical), and kept by dataclasses.replace (an init field).
_WRITTEN = {"internal": True}


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
    prepare: Literal["peft", "none"] = doc(
        "the QLoRA preparation the job runs on the quantised base: peft, peft.prepare_model_for_kbit_training (the "
        "base's non-quantised weights - embeddings, norms, output head, biases - upcast to fp32); none, not called "
        "(the base loaded with torch_dtype = compute_dtype: those weights stay in it). Under bf16-true and "
        "bf16-true-autocast they are bf16 either way (the upcast would contradict the precision)", "peft")


@dataclass
class ExportSpec:
    merge: bool = doc("with model.adapter, also export the base with the adapter merged in (a plain model folder)",
                      False)


@dataclass
class MoeSpec:
    """What a mixture of experts' estimate assumes about routing (a model's experts are found in the model itself)."""

    routing_imbalance: float = doc(
        "the busiest expert's tokens over the balanced share (tokens x experts per token / experts): 1.0 is balanced "
        "routing. Said in the estimate's rows; pilotrun's strategies run every expert on every GPU over that GPU's "
        "tokens, so FLOPs, memory and time there do not depend on it (it is the figure an expert-parallel plan, "
        "not modelled, would be paced by)", 1.0)

    def check(self):
        if not (math.isfinite(self.routing_imbalance) and self.routing_imbalance >= 1.0):
            yield "routing_imbalance", (f"must be a finite number >= 1.0 (1.0: balanced routing; 2.0: the busiest "
                                        f"expert gets twice its share), got {self.routing_imbalance}")


class FactorySection:
    """A section a user factory may be called with (model, data): with ``factory`` set its own keys are legitimate,
    and the factory receives the mapping as the user wrote it (no defaults added)."""

    written: dict[str, Any]

    @staticmethod
    def allow_extra(data: dict) -> bool:
        return isinstance(data, dict) and data.get("factory") is not None

    def factory_mapping(self) -> dict:
        """What the section's factory is called with: the mapping as written (and ``--set``)."""
        return copy.deepcopy(self.written)


@dataclass
class ModelSpec(FactorySection):
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
    attn_implementation: AttnImplementation | None = doc(
        "the attention kernel the long run uses (transformers models): sdpa, flash_attention_2/3 (the flash-attn "
        "package, on the GPU only) or eager; the estimate models what that kernel keeps whatever the CPU trace would "
        "have run (default: the model config's own choice, transformers' sdpa)", None)
    moe: MoeSpec | None = doc("a mixture of experts' routing assumption for the estimate (absent: balanced)", None)
    extra: dict[str, Any] = field(default_factory=dict)  # factory arguments
    written: dict[str, Any] = field(default_factory=dict, metadata=_WRITTEN)

    def tokenizer_source(self, folder: Path) -> TokenizerSource:
        """Where ``tokenizer`` is: a local path (relative to ``folder``, the spec's), or a Hub id in the local cache
        (at ``revision`` when it names ``hf``'s repo). Raises :class:`~pilotrun.config.hub_cache.TokenizerNotFound`."""
        value = self.tokenizer
        assert value is not None
        revision = self.revision if value == self.hf else None
        return locate_tokenizer(value, lambda p: resolve_path(p, folder), revision, hub_id_like=not looks_local(value))

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
        for key in ("hf", "tokenizer"):
            value = getattr(self, key)
            if isinstance(value, str) and (why := path_value_problem(value)) is not None:
                yield key, why
        if self.attn_implementation is not None and self.factory is not None:
            yield "attn_implementation", ("applies to transformers models (model.hf or model.config); a factory "
                                          "model's own calls to scaled_dot_product_attention are estimated as sdpa, "
                                          "its own matmul and softmax as they are")
        if self.quantization is not None:
            if self.factory is not None:
                yield "quantization", ("applies to transformers models (model.hf or model.config); quantise inside "
                                       "your factory instead")
            if self.adapter is None:
                yield "quantization", ("a quantised base cannot be trained: its weights are frozen integers; add "
                                       "model.adapter (LoRA on a 4-bit base is QLoRA) or remove model.quantization")


# data.task values the estimator synthesises batches for but no built-in JSONL reader reads (a described program's
# token-classification or encoder-decoder model: the program reads its own data).
SHAPE_ONLY_TASKS = ("token-classification", "seq2seq-lm")


@dataclass
class DataSpec(FactorySection):
    factory: str | None = doc(
        '"module:function" called with this mapping; returns {"train", "val", "collate", ...} '
        '(README, "Your own model and data")', None)
    task: Literal["causal-lm", "seq-classification", "token-classification", "seq2seq-lm"] | None = doc(
        "built-in task on JSONL data (causal-lm, seq-classification); token-classification and seq2seq-lm are shapes "
        "for estimate, select and plan (a described program's head)", None)
    path: str | dict[str, str] | None = doc(
        "JSONL file (split by group) or {train: file, val: file[, test: file]}; a file may be in a bucket "
        "(s3://, gs://, r2://, cos://, oci://): `plan --skypilot` copies its folder onto the node, where the pilot "
        "reads it", None)
    max_length: int | None = doc("tokens per training example after truncation (the length the long run uses)", None)
    val_fraction: float = doc(
        "share of groups held out for validation when the data is one file (or a factory's 'all')", 0.1)
    test_fraction: float = doc("share of groups held out for test, the same way", 0.0)
    labels: list[str] | None = doc(
        "class names in index order for seq-classification (default: sorted names found in the data)", None)
    num_workers: int = doc("DataLoader worker processes", 0)
    drop_last: bool = doc("drop an epoch's last partial micro batch", False)
    extra: dict[str, Any] = field(default_factory=dict)  # factory arguments
    written: dict[str, Any] = field(default_factory=dict, metadata=_WRITTEN)

    def check(self):
        if (self.factory is None) == (self.task is None):
            yield "", "give exactly one of data.factory or data.task (causal-lm | seq-classification)"
        if self.factory is not None and not re.match(r"^[\w.]+:[\w.]+$", self.factory):
            yield "factory", f"expected 'module:function', got {self.factory!r}"
        if self.task is not None:
            # data.path is required only where data is read (config/load.py): estimate/select/plan need a shape only.
            if self.max_length is None:
                yield "max_length", "missing; built-in tasks truncate to data.max_length"
        paths = self.path.items() if isinstance(self.path, dict) else [("", self.path)]
        for split, value in paths:
            if isinstance(value, str) and (why := path_value_problem(value)) is not None:
                yield f"path.{split}" if split else "path", why
            elif isinstance(value, str) and is_bucket_uri(value) and (why := bucket_data_problem(value)):
                yield f"path.{split}" if split else "path", why
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


# train.activation_checkpointing's policies, cheapest recompute first: the advisor tries them in this order.
# selective-2 recomputes half the matmuls of every block, about the FLOPs every-2 recomputes, but keeps the attention
# outputs every-2 recomputes in one block in 2: it comes first.
AC_POLICIES = ("selective", "selective-2", "every-2", "full")


def ac_policy(value: bool | str | None) -> str | None:
    """The activation checkpointing policy a ``train.activation_checkpointing`` value names: None (off), ``full``
    (``true`` too), ``selective`` (``selective-1`` too), ``selective-N`` or ``every-N``; ValueError naming the
    values otherwise."""
    if value is None or value is False:
        return None
    if value is True or value == "full":
        return "full"
    if value == "selective":
        return value
    if isinstance(value, str) and (m := re.fullmatch(r"(every|selective)-(\d+)", value)):
        kind, n = m.group(1), int(m.group(2))
        if kind == "selective" and n >= 1:
            return "selective" if n == 1 else f"selective-{n}"
        if n >= 2:
            return f"every-{n}"
    raise ValueError(f"expected false, true, full, selective, selective-N (N >= 1: one matmul in N kept) or every-N "
                     f"(N >= 2), got {value!r}")


def matmul_stride(policy: str | None) -> int | None:
    """For a per-op policy (``selective``, ``selective-N``), one matmul output in how many is kept; None otherwise."""
    if policy == "selective":
        return 1
    if policy is not None and policy.startswith("selective-"):
        return int(policy.removeprefix("selective-"))
    return None


def ac_spec_value(policy: str | None) -> bool | str:
    """A policy as ``train.activation_checkpointing`` holds it (the inverse of :func:`ac_policy`): None is
    ``false``, full is ``true`` (as the spec has always said it), the others their names."""
    if policy is None:
        return False
    return True if policy == "full" else policy


def ac_variant(policy: str) -> str:
    """The `pilotrun variants` variant that runs a policy (a name in BUILTIN_VARIANTS)."""
    return "checkpointing" if policy == "full" else f"checkpointing-{policy}"


def ac_words(policy: str | None) -> str:
    """How a row or the advisor names a policy."""
    if policy is None:
        return "no activation checkpointing"
    if policy == "full":
        return "activation checkpointing"
    if policy == "selective":
        return "activation checkpointing (selective: matmul outputs kept)"
    if (stride := matmul_stride(policy)) is not None:
        return f"activation checkpointing (per op: attention outputs and 1 matmul in {stride} kept)"
    return f"activation checkpointing (1 block in {policy.removeprefix('every-')})"


@dataclass
class TrainSpec:
    micro_batch_size: int = doc("examples per forward/backward on one device")
    updates: int = doc(
        "optimizer updates of the real run; sizes the lr schedule (the pilot runs pilot.updates of them)")
    optimizer: OptimizerSpec = doc("optimizer and its hyper-parameters")
    grad_accum_steps: int = doc("micro batches accumulated per optimizer update", 1)
    precision: Precision = doc(
        "fp32; bf16 autocast over fp32 weights (under fsdp the blocks are also gathered in bf16 and their gradients "
        "reduced in fp32: FSDP2's MixedPrecisionPolicy, as for fp16 and fp8); fp16 autocast with a grad scaler; "
        "bf16-true: weights, gradients and "
        "optimizer state held in bf16, no autocast (torch_dtype=bfloat16 fine-tuning); bf16-true-autocast: the same "
        "bf16 weights with bf16 autocast over them (torch_dtype=bfloat16 with the Trainer's bf16=True, accelerate's "
        "mixed_precision='bf16' or Lightning's 'bf16-mixed'): the ops on autocast's fp32 list (losses; on CUDA also "
        "softmax, log_softmax and norms) run in fp32; fp8: bf16's setup (fp32 weights, bf16 autocast) with every "
        "Linear but the output head whose dimensions are multiples of 16 trained through torchao's float8 (its three "
        "matmuls on float8 operands, train.fp8_recipe): needs torchao and an accelerator with FP8 matmuls (Ada, "
        "Hopper, MI300X) or the CPU", "fp32")
    fp8_recipe: Fp8Recipe = doc(
        "with precision fp8, how torchao scales the float8 operands: tensorwise, one scale per tensor (input and "
        "weight e4m3, output gradient e5m2: torchao's default and fastest); rowwise, one scale per row, all e4m3, "
        "scales rounded to powers of 2 (more accurate with outliers, slower). Under another precision it is the recipe "
        "the fp8 variant of `pilotrun variants` runs", "tensorwise")
    scheduler: SchedulerSpec = doc("learning-rate schedule (a name or a mapping)", SchedulerSpec)
    max_grad_norm: float | None = doc("clip the global gradient norm to this (null: measure, do not clip)", 1.0)
    activation_checkpointing: bool | str = doc(
        "recompute activations in backward (Hugging Face models): false; true or full: every block's activations "
        "recomputed; selective: per op, every matmul and attention output kept and the rest recomputed; "
        "selective-N: per op, the attention outputs and one matmul output in N kept in each block (the first, then "
        "every Nth), the rest recomputed: selective-2 is torchtitan's op policy; every-N: one block in N (N >= 2) "
        "recomputed, the others kept", False)
    compile: CompileScope = doc(
        "torch.compile (inductor) in pilotrun's loop: off (eager); model: the whole model as one torch.compile; "
        "blocks: each repeated block (a transformer layer) compiled on its own, as torchtitan does (one graph reused "
        "by every layer: shorter compiles). The pilot reports the compile seconds and the recompiles; the estimate "
        "models what the compiled graph keeps and charges the compile once per process start", "off")
    device: str = doc("auto (first accelerator, else CPU), cpu, cuda, cuda:N or mps", "auto")
    shuffle: bool = doc("shuffle the training set each epoch (seeded)", True)
    loss_normalization: Literal["auto", "per_micro_batch"] = doc(
        "auto: token-exact accumulation via num_items_in_batch when the model accepts it; per_micro_batch: "
        "declare on purpose that each micro batch's own mean is averaged (accum_equivalence then only reports)", "auto")

    @staticmethod
    def normalize(data: Any) -> Any:
        # One spelling per policy, so the config hash (and the ledger's lookups by it) agree: full is written true
        # (as the spec has always said it), every-02 is every-2. A value ac_policy refuses is left for check().
        if isinstance(data, dict) and data.get("compile") is False:
            data = {**data, "compile": "off"}  # YAML 1.1 (the loader, --set) reads an unquoted `off` as false
        ac = data.get("activation_checkpointing") if isinstance(data, dict) else None
        if isinstance(ac, str):
            try:
                policy = ac_policy(ac)
            except ValueError:
                return data
            return {**data, "activation_checkpointing": ac_spec_value(policy)}
        return data

    def check(self):
        for name in ("micro_batch_size", "grad_accum_steps", "updates"):
            value = getattr(self, name)
            if isinstance(value, int) and value < 1:
                yield name, f"must be at least 1, got {value}"
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            yield "max_grad_norm", "must be positive, or null to disable clipping"
        if not re.match(r"^(auto|cpu|mps|cuda(:\d+)?)$", self.device):
            yield "device", f"expected auto, cpu, cuda, cuda:N or mps, got {self.device!r}"
        try:
            ac_policy(self.activation_checkpointing)
        except ValueError as exc:
            yield "activation_checkpointing", str(exc)


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
    before: int | Literal["auto"] = doc(
        "updates the interrupted process runs before it saves and is killed. auto: for a program, at its own first "
        "checkpoint (its save_steps, eval_interval, epoch end: the first job.saved the control run reports without "
        "pilotrun asking), so the resume is proven where the long run really resumes from; pilotrun asks for a save "
        "at pilot.resume.auto_within if there is none by then. auto for pilotrun's own loop: 2. A number: pilotrun "
        "asks for the save there (job.should_save), and the row says whether the program saves there on its own",
        "auto")
    after: int = doc("updates the restored process runs; compared with the control run's", 2)
    rtol: float = doc(
        "relative tolerance for loss and gradient norm off CPU or in bf16/fp16 (CPU fp32 is bitwise)", 1e-3)
    auto_within: int = doc(
        "with before: auto (a program), the update by which the program should have saved on its own; pilotrun "
        "asks for a save there otherwise, and the row warns that the long run never resumes from that point", 50)

    def check(self):
        if self.before != "auto" and self.before < 1:
            yield "before", f"must be at least 1 or auto, got {self.before}"
        for name in ("after", "auto_within"):
            if getattr(self, name) < 1:
                yield name, f"must be at least 1, got {getattr(self, name)}"
        if self.rtol < 0:
            yield "rtol", "must be 0 or more"


# The fixes `pilotrun variants` runs beside the control unless pilot.variants.run names others (their order is that
# of docs/guides/fix-memory.md, "What runs": micro batch, checkpointing, precision). The definitions (what each
# sets) are pilotrun.variants.define's.
BUILTIN_VARIANTS = ("micro-batch-half", "checkpointing-selective", "checkpointing-selective-2", "checkpointing-every-2",
                    "checkpointing", "bf16", "fp16", "bf16-true")
# Built-in variants that run only where pilot.variants.run names them: bf16-true-autocast holds the same bf16 weights
# as bf16-true and saves no memory beside it; it is run to measure autocast's numerics and time over those weights.
# fp8 saves no memory either (its float8 copies are temporaries) and needs torchao: it is run to measure float8's
# numerics against bf16 (and its time where the device has FP8 matmuls).
NAMED_ONLY_VARIANTS = ("bf16-true-autocast", "fp8")


@dataclass
class VariantsSpec:
    updates: int = doc(
        "updates the control and each variant run from the same initial weights on the same examples; the first 2 "
        "are measured for memory, the rest timed in interleaved rounds (at least 5: 3 rounds for the median)", 10)
    val_loss_rtol: float = doc(
        "the quality check: a variant's validation loss after its updates must be within this relative difference "
        "of the control's (|v - c| / |c|), else it fails; beyond half of it the variant warns", 0.02)
    run: list[str] | None = doc(
        f"the built-in variants to run (default: every one that differs from the control: "
        f"{', '.join(BUILTIN_VARIANTS)}; {', '.join(NAMED_ONLY_VARIANTS)}: each runs only when named here)", None)
    custom: dict[str, dict[str, Any]] = doc(
        "variants of your own: a name -> the keys they change, as --set takes them "
        "(e.g. {lr-half: {train.optimizer.lr: 1.5e-3}})", {})

    def check(self):
        if self.updates < 5:
            yield "updates", f"must be at least 5 (2 measured for memory, at least 3 timed rounds), got {self.updates}"
        if not 0 < self.val_loss_rtol < 1:
            yield "val_loss_rtol", f"must be between 0 and 1 (a relative difference), got {self.val_loss_rtol}"
        for name in self.run or []:
            if name not in BUILTIN_VARIANTS + NAMED_ONLY_VARIANTS:
                yield "run", (f"unknown variant {name!r}; the built-in ones are "
                              f"{', '.join(BUILTIN_VARIANTS + NAMED_ONLY_VARIANTS)}")
        for name, keys in self.custom.items():
            if name == "control" or name in BUILTIN_VARIANTS + NAMED_ONLY_VARIANTS:
                yield "custom", f"{name!r} is a built-in name; give your variant another name"
            elif (why := name_problem(name)) is not None:  # a variant's name is a ledger key and a report's label
                yield "custom", f"variant name: {why}"
            if not isinstance(keys, dict) or not keys:
                yield "custom", f"{name!r}: give a mapping of the keys it changes, e.g. {{train.optimizer.lr: 1e-3}}"


@dataclass
class PilotSpec:
    updates: int = doc("updates the pilot runs: the first (first_step) and the rest (steady_step)", 6)
    gates: list[str] | None = doc("gates to run (default: all, in order)", None)
    inspect: InspectSpec = doc("the inspect gate", InspectSpec)
    overfit: OverfitSpec = doc("the overfit gate", OverfitSpec)
    resume: ResumeSpec = doc("the resume gate", ResumeSpec)
    variants: VariantsSpec = doc("`pilotrun variants`: memory fixes run and measured beside the control",
                                 VariantsSpec)
    factory_timeout: float | None = doc(
        "seconds model.factory / data.factory may take to import, and again to return, before the spec check or the "
        "load gate gives up on it (null: no limit; enforced in each process's main thread)", DEFAULT_FACTORY_TIMEOUT)

    def check(self):
        if self.updates < 2:
            yield "updates", f"must be at least 2 (one first_step and at least one steady_step), got {self.updates}"
        if self.factory_timeout is not None and self.factory_timeout <= 0:
            yield "factory_timeout", f"must be positive, or null for no limit, got {self.factory_timeout}"


@dataclass
class DistributedSpec:
    # The registry's names (pilotrun.strategies.STRATEGIES), mirrored in config/strategy_names.py, which the
    # registry checks at its import; an alias (`none`) is read as the name it stands for.
    strategy: StrategyName = doc(
        "single: one process; ddp: a full replica per process, gradients all-reduced; fsdp: FSDP2 fully_shard of "
        "each repeated block and the root (launch with `pilotrun launch --nproc-per-node N` or torchrun)",
        DEFAULT_STRATEGY)
    offload: Literal["none", "cpu"] = doc(
        "none: parameters, gradients and optimizer state stay on the GPUs; cpu: FSDP2's CPUOffloadPolicy(pin_memory="
        "True) keeps each rank's shard of them in host memory (parameters and gradients pinned), copies a layer's "
        "parameter shard to the GPU before its all-gather and each gradient shard back after its reduce-scatter, and "
        "runs the optimizer step on the CPU: far less GPU memory, a slower update (fsdp only; the estimate adds the "
        "PCIe copies, the CPU step and the host memory per node)", "none")

    def check(self):
        if self.offload != "none" and self.strategy not in OFFLOADING_STRATEGIES:
            yield "offload", (f"{self.offload} needs distributed.strategy {' or '.join(OFFLOADING_STRATEGIES)} "
                              f"(FSDP2's CPUOffloadPolicy), not {self.strategy!r}: set distributed.strategy: "
                              f"{OFFLOADING_STRATEGIES[0]}, or distributed.offload: none")

    @staticmethod
    def normalize(data: Any) -> Any:
        # Specs written before the spec, the CLI and the estimator shared one vocabulary said `none`.
        named = data.get("strategy") if isinstance(data, dict) else None
        if isinstance(named, str) and named in STRATEGY_ALIASES:
            return {**data, "strategy": STRATEGY_ALIASES[named]}
        return data

