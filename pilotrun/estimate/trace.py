"""Trace the job's real update with fake tensors: no weights, no GPU, no real memory.

The model is built on ``meta`` and materialised with ``to_empty`` under
``FakeTensorMode(allow_non_fake_inputs=True)`` on the CPU device (a backward pass on a
fake CUDA device aborts the process without a GPU). Two updates are traced so that
the lazily created optimizer state is live in the second; evaluation is traced apart
at ``eval.max_length`` × ``eval.batch_size``. A :class:`CategoryTracker` gives the peak and its
breakdown (parameters, gradients, optimizer state and step temporaries, activations),
unrounded and with every storage rounded to 512 B as the CUDA caching allocator does
(``MemTracker`` gives the same totals, at a per-op cost that grows with the number of
modules: minutes for a 7B model). ``FlopCounterMode`` counts FLOPs, with formulas
added for the CPU attention kernels it does not know, and :class:`~pilotrun.estimate.ops.OpCosts` keeps each
op's FLOPs and bytes moved for the time model (one micro batch's forward and backward, one optimizer step).

Run it through :func:`pilotrun.estimate.worker.trace_in_subprocess`: a C++ abort in
a trace must not take the tool down.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from ..config.spec import Spec
from ..ledger.records import GateName
from ..measure.tensors import CategoryTracker
from ..models.attention import IMPLEMENTATIONS, AttentionRecord, model_target_attention
from ..models.loading import build_model
from ..models.structure import largest_block
from ..train.batches import autocast_for, item_length, seq_len, supervised_count
from ..train.loss import LossPolicy, decide_loss_policy, window_backward
from .adapted import Adaptation, adapt, fsdp_parts, trace_optimizer
from .autocast_lists import cuda_autocast_lists
from .compiled import compiled_facts
from .fp8 import fp8_facts, fp8_modules
from .moe import allow_fallback_dtypes, describe, register_expert_flops, with_costs
from .ops import OpCosts

ROUND = 512  # bytes: the CUDA caching allocator's block granularity


_FLOPS_REGISTERED = False


def _register_cpu_attention_flops() -> None:
    """FlopCounterMode has no formula for the CPU flash-attention kernels: count them as SDPA."""
    global _FLOPS_REGISTERED
    import torch.utils.flop_counter as fc

    if _FLOPS_REGISTERED:
        return
    _FLOPS_REGISTERED = True
    aten = torch.ops.aten
    table = getattr(fc, "flop_registry", {})
    fwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    bwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if fwd is not None and fwd.default not in table:
        @fc.register_flop_formula(fwd)
        def _fwd(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
            return fc.sdpa_flop_count(query_shape, key_shape, value_shape)
    if bwd is not None and bwd.default not in table:
        @fc.register_flop_formula(bwd)
        def _bwd(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
            return fc.sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


@dataclass
class StageTrace:
    peak_bytes: int                      # the stage's peak of live storage bytes, unrounded
    peak_bytes_rounded: int              # the same storages, each rounded up to 512 B
    breakdown: dict[str, int]            # at the peak: parameters, buffers, gradients, optimizer, activations
    tensors: int = 0                     # storages created in the stage
    flops: int = 0
    seq_len: int = 0
    batch_size: int = 0
    optimizer_step_extra_bytes: int = 0  # temporaries of optimizer.step() above what was live before it
    # The time model's input (ops.roofline_seconds): each op of one micro batch's forward and backward, and of
    # one optimizer step, as [dtype, flops, bytes moved, count]. Empty in traces written before them.
    ops: list[list] = field(default_factory=list)
    optimizer_ops: list[list] = field(default_factory=list)
    # The attention kernels' rows of ``ops`` (FLOPs quadratic in the length): the time at the data's shorter lengths
    # scales them apart from the rest (estimate/lengths.py). Empty in traces written before them.
    attention_ops: list[list] = field(default_factory=list)
    # The matmuls FP8 training would run in float8 (estimate/fp8.py), a subset of ``ops``, as [dtype, flops, bytes
    # read, bytes written, count]. Empty in traces written before them.
    fp8_ops: list[list] = field(default_factory=list)
    # The experts' grouped matmuls' rows of ``ops`` (estimate/moe.py): their FLOPs and dtype, said in the row.
    expert_ops: list[list] = field(default_factory=list)
    # The matmuls of ``ops`` with a leading dimension off the tensor cores' alignment (ops.OpCosts.unaligned_rows):
    # [dtype, M, N, K, flops, count, [odd leading dimensions], [modules]]; estimate/alignment.py says them. Empty in
    # traces written before them.
    unaligned_matmuls: list[list] = field(default_factory=list)
    # Per phase ("compute": the first micro batch's forward and backward, "accumulating": the later micro batches
    # with the earlier ones' gradients held, "optimizer": the step), the moments that bound the peak at
    # other micro batches: [{"bytes", "breakdown"}]. Under activation checkpointing the stage's overall peak
    # is the optimizer step, whose breakdown has no activations at all: scaling that breakdown's activations
    # said any micro batch fits (issue 13, "largest micro batch 1023").
    phases: dict[str, list[dict]] = field(default_factory=dict)


@dataclass
class TraceResult:
    stages: dict[str, StageTrace]
    parameters: int
    trainable_parameters: int
    parameter_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    buffer_bytes: int
    largest_layer_bytes: int             # parameters of the largest repeated block (FSDP's unit in flight)
    largest_layer: str
    layers: int
    foreach: bool
    precision: str
    activation_checkpointing: bool | str  # as train.activation_checkpointing names it (config.sections.ac_policy)
    seconds: float
    grad_accum_steps: int = 1
    max_positions: int | None = None     # the model's position limit, when its config has one
    notes: list[str] = field(default_factory=list)
    optimizer: str = ""                  # the spec's optimizer name and the path traced
    # Adapter / quantised base / bf16-true: trainable share, adapter and quantised bytes (adapted.Adaptation).
    adaptation: dict = field(default_factory=dict)
    # Parameter bytes as FSDP2 moves them, of the largest block, the root and the model (adapted.fsdp_parts).
    fsdp_parts: dict = field(default_factory=dict)
    # The attention kernel modelled (models.attention.AttentionRecord.to_dict): the implementation, the target's
    # kernel, its calls in one micro batch's forward, and what CPU dispatch would have run instead.
    attention: dict = field(default_factory=dict)
    # FP8 training (estimate/fp8.fp8_facts): the Linears it would convert and those skipped, or why not modelled.
    fp8: dict = field(default_factory=dict)
    # A mixture of experts (estimate/moe.py): experts, active per token, their FLOPs and dtype, the routing assumed.
    # Empty for a model without experts.
    moe: dict = field(default_factory=dict)
    # train.compile (estimate/compiled.compiled_facts): per block, what eager and the min-cut partitioned graph save
    # for backward and their element-wise bytes, or why not modelled. Empty when the job is not compiled.
    compiled: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


# Micro-batch scales at which each phase's peak is kept. The peak at scale s is the largest
# (other bytes + s x activation bytes) over the phase: a line per moment, and the peak is their upper
# envelope. The moment of the largest total at the traced batch (s = 1) is not the moment of the largest
# activations (start of backward, before gradients exist), so keeping only the s = 1 moment under-predicts
# larger batches (by 16% at micro batch 29 for the 4-layer 7B shape with checkpointing). Between two kept
# scales the envelope is under-estimated by at most the gap between their lines.
SCALES = (0.0, 0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 1024.0)


class PhaseTracker(CategoryTracker):
    """A CategoryTracker that also keeps, inside and outside optimizer.step(), the moments that bound the peak
    at other micro batches (see SCALES)."""

    def __init__(self, *args, **kwargs) -> None:
        # Set before the base class registers the existing state (its _add calls ours). "compute" is an update's
        # first micro batch, "accumulating" the later ones (the earlier micro batches' gradients held): a device
        # that runs one micro batch per update (the accumulation split over the GPUs) never reaches the latter.
        self.best: dict[str, list[tuple[float, dict]]] = {name: [(-1.0, {})] * len(SCALES)
                                                           for name in ("compute", "accumulating", "optimizer")}
        self.window = "compute"
        super().__init__(*args, **kwargs)

    def _add(self, st, category: str) -> None:
        super()._add(st, category)
        # Live bytes only grow in _add, so every line's maximum is reached here.
        acts = self.live["activations"]
        others = self.live_bytes - acts
        best = self.best["optimizer" if self._phase == "optimizer" else self.window]
        snapshot = None
        for i, s in enumerate(SCALES):
            value = others + s * acts
            if value > best[i][0]:
                snapshot = snapshot or dict(self.live)
                best[i] = (value, snapshot)

    def phases(self) -> dict[str, list[dict]]:
        """Per phase, the distinct moments kept: each its live bytes and breakdown."""
        out: dict[str, list[dict]] = {}
        for phase, best in self.best.items():
            seen: list[dict] = []
            for value, breakdown in best:
                if value >= 0 and breakdown not in seen:
                    seen.append(breakdown)
            if seen:
                out[phase] = [{"bytes": sum(b.values()), "breakdown": b} for b in seen]
        return out


def _synthetic_batch(spec: Spec, config, batch: int, length: int, head: str) -> dict:
    vocab = int(getattr(config, "vocab_size", 0) or 32000)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, length), generator=g)
    out = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    n = int(getattr(config, "num_labels", 2) or 2)
    if head == "seq-classification":
        out["labels"] = torch.randint(0, n, (batch,), generator=g)
    elif head == "token-classification":
        out["labels"] = torch.randint(0, n, (batch, length), generator=g)
    else:  # causal-lm, and seq2seq-lm: its decoder reads the labels shifted right, as long as the input
        out["labels"] = ids.clone()
    return out


def _factory_batches(spec: Spec, batch: int, split: str) -> dict:
    """A user's data factory, collated over its longest items (real tensors, used as fake inputs)."""
    from ..data.bundle import build_data

    data = build_data(spec.data, spec.build_context(), None, spec.eval_max_length)
    ds = data.train if split == "train" else data.val
    scan = min(len(ds), 5000)
    longest = sorted(((item_length(ds[i], data.collate), i) for i in range(scan)), reverse=True)[:batch]
    return data.collate([ds[i] for _, i in longest])


@dataclass
class _Job:
    """What a trace runs: the model as the estimator builds it, its loss policy and its real input batches."""

    model: torch.nn.Module   # on the meta device until materialised under the fake mode
    config: object
    policy: LossPolicy
    train_batch: dict
    eval_batch: dict
    micro_batch: int
    notes: list[str]
    adaptation: Adaptation
    attention: str           # the attention implementation the target runs (models.attention.IMPLEMENTATIONS)


def _prepare(spec: Spec, ac: bool | str, mb: int, seq: int | None) -> _Job:
    t = spec.train
    length = seq or spec.data.max_length or 0
    eval_len = max(spec.eval_max_length or length, length) if seq is None else max(seq, spec.eval_max_length or 0)
    loaded = build_model(spec.model, spec.build_context(), spec.data.labels, meta=True, activation_checkpointing=ac)
    notes = [loaded.checkpointing_unavailable] if loaded.checkpointing_unavailable else []
    model, adaptation = adapt(loaded.model, spec)
    notes += adaptation.notes
    policy = decide_loss_policy(loaded.model, t.loss_normalization)
    # Inputs are real tensors made before the fake mode starts: their values (label counts) are known.
    if spec.data.factory is not None:
        train_batch = _factory_batches(spec, mb, "train")
        eval_batch = _factory_batches(spec, spec.eval_batch_size, "val")
    else:
        train_batch = _synthetic_batch(spec, loaded.config, mb, length, loaded.head)
        eval_batch = _synthetic_batch(spec, loaded.config, spec.eval_batch_size, eval_len, loaded.head)
    return _Job(model, loaded.config, policy, train_batch, eval_batch, mb, notes, adaptation,
                attention_implementation(spec, loaded.config))


def attention_implementation(spec: Spec, config) -> str:
    """What the long run's attention is: the spec's ``model.attn_implementation``, else the built config's own
    (transformers picks sdpa where the model supports it, else eager), else sdpa (a factory model's SDPA calls)."""
    chosen = spec.model.attn_implementation or getattr(config, "_attn_implementation", None) or "sdpa"
    return chosen if chosen in IMPLEMENTATIONS else "sdpa"


def autocast_precision(precision: str) -> str:
    """The precision the loop's autocast sees: bf16-true holds bf16 weights and runs without autocast (as fp32 does);
    bf16-true-autocast runs bf16 autocast over the same weights (``train.batches.autocast_for``)."""
    return "fp32" if precision == "bf16-true" else precision


def _trace_training(job: _Job, model, opt, spec: Spec, target: str, num_items: int,
                    attention: AttentionRecord) -> dict[str, StageTrace]:
    """first_step and steady_step: two micro batches per update, two updates (the second with optimizer state)."""
    t = spec.train
    precision = autocast_precision(t.precision)
    device = torch.device("cpu")
    # Micro batches after the second repeat the second exactly (gradients already live): trace two per
    # update and scale the FLOPs of one by the accumulation.
    traced = min(t.grad_accum_steps, 2)
    ids = [f"s{i}" for i in range(job.micro_batch)]
    # The loop holds its inputs too: the whole window on the CPU (fetched before the forward), one micro
    # batch at a time on an accelerator (moved just before its forward).
    held = t.grad_accum_steps if target == "cpu" else 1
    stages: dict[str, StageTrace] = {}
    for stage in (GateName.FIRST_STEP, GateName.STEADY_STEP):
        with PhaseTracker(model, opt, fake=True, round_to=ROUND) as tracker:
            inputs = [_clone(job.train_batch) for _ in range(held)]
            model.train()
            for k in range(traced):
                tracker.window = "compute" if k == 0 else "accumulating"
                window_backward(model, [(ids, inputs[min(k, held - 1)])], job.policy, device, precision,
                                num_items=num_items, stats=False)
            tracker.window = "compute"
            before = tracker.live_bytes
            opt.step()
            opt.zero_grad(set_to_none=True)
        stages[stage] = StageTrace(tracker.peak_bytes, tracker.peak_rounded, dict(tracker.peak_breakdown),
                                   tracker.tensors, 0, seq_len(job.train_batch), job.micro_batch,
                                   optimizer_step_extra_bytes=max(0, tracker.step_peak - before),
                                   phases=tracker.phases())
    # FLOPs and bytes in a separate pass: FlopCounterMode keeps tensors alive (the recomputed ones under
    # activation checkpointing), which would inflate a peak measured at the same time.
    counter = OpCosts(fp8_modules(model, spec))
    with counter, attention.counting():   # and the attention calls of one micro batch, as the row says them
        window_backward(model, [(ids, _clone(job.train_batch))], job.policy, device, precision,
                        num_items=num_items, stats=False)
    step = OpCosts()
    with step:
        # The loop measures (and with max_grad_norm clips) the gradient norm before every optimizer step.
        grads = [p for p in model.parameters() if p.grad is not None]
        torch.nn.utils.clip_grad_norm_(grads, t.max_grad_norm if t.max_grad_norm is not None else float("inf"))
        opt.step()
    model.zero_grad(set_to_none=True)
    for traced_stage in stages.values():
        traced_stage.flops = counter.get_total_flops() * t.grad_accum_steps
        traced_stage.ops = counter.rows()
        traced_stage.attention_ops = counter.attention_rows()
        traced_stage.fp8_ops = counter.fp8_rows()
        traced_stage.expert_ops = counter.expert_rows()
        traced_stage.unaligned_matmuls = counter.unaligned_rows()
        traced_stage.optimizer_ops = step.rows()
    return stages


def _trace_eval(job: _Job, model, opt, spec: Spec) -> StageTrace:
    device = torch.device("cpu")
    precision = autocast_precision(spec.train.precision)
    with PhaseTracker(model, opt, fake=True, round_to=ROUND) as tracker:
        model.eval()
        with torch.no_grad(), autocast_for(device, precision):
            model(**_clone(job.eval_batch))
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad(), autocast_for(device, precision):
        model(**_clone(job.eval_batch))
    ids = job.eval_batch.get("input_ids")
    batch = int(ids.shape[0]) if isinstance(ids, torch.Tensor) else spec.eval_batch_size
    return StageTrace(tracker.peak_bytes, tracker.peak_rounded, dict(tracker.peak_breakdown), tracker.tensors,
                      counter.get_total_flops(), seq_len(job.eval_batch), batch, phases=tracker.phases())


def _state_bytes(model, opt, adaptation: Adaptation) -> dict:
    params = list({id(p): p for p in model.parameters()}.values())
    return {
        # A quantised base's packed storage is not its parameter count: the model's own count is.
        "parameters": adaptation.base_parameters + adaptation.adapter_parameters,
        "trainable_parameters": sum(p.numel() for p in params if p.requires_grad),
        "parameter_bytes": sum(p.numel() * p.element_size() for p in params),
        "gradient_bytes": sum(p.numel() * p.element_size() for p in params if p.requires_grad),
        "optimizer_state_bytes": _optimizer_bytes(opt),
        "buffer_bytes": sum(b.numel() * b.element_size() for b in model.buffers()),
    }


def _optimizer_bytes(opt) -> int:
    """State bytes, each storage once (the 8-bit optimizers share their quantisation maps)."""
    seen: dict[int, int] = {}
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                seen[id(v)] = v.numel() * v.element_size()
    return sum(seen.values())


def trace_job(spec: Spec, target: str = "cuda", activation_checkpointing: bool | str | None = None,
              micro_batch_size: int | None = None, seq_len: int | None = None) -> TraceResult:
    """Trace first_step, steady_step and eval for ``target`` ("cuda" uses the optimizer's foreach path)."""
    t0 = time.perf_counter()
    _register_cpu_attention_flops()
    t = spec.train
    ac = t.activation_checkpointing if activation_checkpointing is None else activation_checkpointing
    torch.manual_seed(spec.seed)
    job = _prepare(spec, ac, micro_batch_size or t.micro_batch_size, seq_len)
    moe = _moe_facts(spec, job)
    layer_name, layer_bytes, layers = largest_block(job.model)
    parts = fsdp_parts(job.model, layer_name)
    num_items = t.grad_accum_steps * supervised_count(job.train_batch, job.policy.shift_labels)
    shared = _shared_parameters(job.model)
    # The target's autocast lists too (estimate/autocast_lists.py): CUDA runs softmax, norms and losses in fp32.
    with FakeTensorMode(allow_non_fake_inputs=True), cuda_autocast_lists(target), \
            model_target_attention(job.attention, job.model, target) as attention:
        model = job.model.to_empty(device="cpu")
        _retie(model, shared)
        opt, opt_path = trace_optimizer(model, spec, target)
        foreach = any(g.get("foreach") for g in opt.param_groups)
        stages = _trace_training(job, model, opt, spec, target, num_items, attention)
        stages[GateName.EVAL] = _trace_eval(job, model, opt, spec)
        totals = _state_bytes(model, opt, job.adaptation)
        compiled = _compiled(spec, job, model, layer_name, layers, ac)
    max_pos = getattr(job.config, "max_position_embeddings", None) if job.config is not None else None
    return TraceResult(stages=stages, grad_accum_steps=t.grad_accum_steps, max_positions=max_pos,
                       largest_layer_bytes=layer_bytes, largest_layer=layer_name, layers=layers, foreach=foreach,
                       precision=t.precision, activation_checkpointing=ac, seconds=time.perf_counter() - t0,
                       notes=job.notes, optimizer=opt_path, adaptation=asdict(job.adaptation),
                       attention=attention.to_dict(), fp8=fp8_facts(job.model, spec), moe=with_costs(
                           moe, stages[GateName.STEADY_STEP].expert_ops,
                           job.micro_batch * stages[GateName.STEADY_STEP].seq_len, t.grad_accum_steps),
                       compiled=compiled, fsdp_parts=parts, **totals)


def _compiled(spec: Spec, job: _Job, model, block: str, layers: int, ac: bool | str) -> dict:
    """train.compile's facts (estimate/compiled.py): one block's call as the loop's forward makes it, eager and
    through AOT autograd's min-cut partitioner, under the trace's fake mode and the loop's autocast."""
    precision = autocast_precision(spec.train.precision)
    model.train()
    return compiled_facts(model, block, layers, lambda: model(**_clone(job.train_batch)), spec.train.compile, ac,
                          lambda: autocast_for(torch.device("cpu"), precision))


def _moe_facts(spec: Spec, job: _Job) -> dict:
    """The model's experts (estimate/moe.py), with their kernels' FLOP formulas and meta dtypes in place (after the
    model is built: transformers registers its own expert ops on import)."""
    register_expert_flops()
    allow_fallback_dtypes()
    imbalance = spec.model.moe.routing_imbalance if spec.model.moe is not None else 1.0
    facts = describe(job.model, job.config, imbalance)
    if not facts and spec.model.moe is not None:
        job.notes.append("model.moe is set but the model has no experts (no stacked expert parameters): ignored")
    return facts


def _shared_parameters(model: torch.nn.Module) -> list[list[str]]:
    """Names that point at one Parameter (tied embeddings): to_empty would untie them."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _retie(model: torch.nn.Module, shared: list[list[str]]) -> None:
    for names in shared:
        first = model.get_parameter(names[0])
        for name in names[1:]:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner) if owner else model, attr, first)


def _clone(batch: dict) -> dict:
    """The batch as the loop holds it: allocated inside the trace (fake), so its bytes are counted."""
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
