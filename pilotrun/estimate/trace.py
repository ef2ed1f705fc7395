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
added for the CPU attention kernels it does not know.

Run it through :func:`pilotrun.estimate.worker.trace_in_subprocess`: a C++ abort in
a trace must not take the tool down.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass, field

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from ..config.spec import Spec
from ..measure.tensors import CategoryTracker
from ..train.loop import autocast_for, decide_loss_policy, window_backward
from ..train.optim import build_optimizer

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
    activation_checkpointing: bool
    seconds: float
    grad_accum_steps: int = 1
    max_positions: int | None = None     # the model's position limit, when its config has one
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _synthetic_batch(spec: Spec, config, batch: int, length: int, head: str) -> dict:
    vocab = int(getattr(config, "vocab_size", 0) or 32000)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, length), generator=g)
    out = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if head == "seq-classification":
        n = int(getattr(config, "num_labels", 2) or 2)
        out["labels"] = torch.randint(0, n, (batch,), generator=g)
    else:
        out["labels"] = ids.clone()
    return out


def _factory_batches(spec: Spec, batch: int, split: str) -> dict:
    """A user's data factory, collated over its longest items (real tensors, used as fake inputs)."""
    from ..data.bundle import build_data
    from ..gates.eval import _item_length

    data = build_data(spec, None)
    ds = data.train if split == "train" else data.val
    scan = min(len(ds), 5000)
    longest = sorted(((_item_length(ds[i], data.collate), i) for i in range(scan)), reverse=True)[:batch]
    return data.collate([ds[i] for _, i in longest])


def _build_meta_model(spec: Spec):
    """The model on the meta device: shapes only, no weights read, no memory."""
    from ..models.loading import _head_for, _hf_classes, _local

    labels = spec.data.labels
    if spec.model.factory is not None:
        from ..config.spec import import_factory

        with torch.device("meta"):
            model = import_factory(spec.model.factory, spec.folder)(spec.model_mapping())
        return model, getattr(model, "config", None), "custom"
    import transformers

    head, _ = _head_for(spec, labels)
    extra = {"num_labels": len(labels)} if head == "seq-classification" and labels else {}
    if spec.model.config is not None:
        cfg = dict(spec.model.config)
        config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg, **extra)
    else:
        local = _local(spec, spec.model.hf)
        config = transformers.AutoConfig.from_pretrained(str(local) if local else spec.model.hf,
                                                         revision=spec.model.revision,
                                                         trust_remote_code=spec.model.trust_remote_code, **extra)
    with torch.device("meta"):
        model = _hf_classes(head).from_config(config)
    return model, config, head


def _largest_layer(model: torch.nn.Module) -> tuple[str, int, int]:
    """The largest block among repeated layers (a ModuleList's children): what FSDP unshards at once."""
    best, best_bytes, count = "", 0, 0
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) > 1:
            for i, child in enumerate(mod):
                n = sum(p.numel() * p.element_size() for p in child.parameters())
                if n > best_bytes:
                    best, best_bytes = f"{name}.{i}", n
            count = max(count, len(mod))
    if not best:
        best, best_bytes = "(whole model)", sum(p.numel() * p.element_size() for p in model.parameters())
    return best, best_bytes, count


def trace_job(spec: Spec, target: str = "cuda", activation_checkpointing: bool | None = None,
              micro_batch_size: int | None = None, seq_len: int | None = None) -> TraceResult:
    """Trace first_step, steady_step and eval for ``target`` ("cuda" uses the optimizer's foreach path)."""
    t0 = time.perf_counter()
    _register_cpu_attention_flops()
    t = spec.train
    ac = t.activation_checkpointing if activation_checkpointing is None else activation_checkpointing
    mb = micro_batch_size or t.micro_batch_size
    length = seq_len or spec.data.max_length or 0
    eval_len = max(spec.eval_max_length or length, length) if seq_len is None else max(seq_len, spec.eval_max_length or 0)
    notes: list[str] = []
    torch.manual_seed(spec.seed)
    meta_model, config, head = _build_meta_model(spec)
    if ac:
        from ..models.loading import enable_activation_checkpointing

        if not enable_activation_checkpointing(meta_model):
            notes.append("activation checkpointing requested but the model has no gradient_checkpointing_enable()")
    layer_name, layer_bytes, layers = _largest_layer(meta_model)
    foreach = target != "cpu"
    policy = decide_loss_policy(meta_model, t.loss_normalization)
    # Inputs are real tensors made before the fake mode starts: their values (label counts) are known.
    if spec.data.factory is not None:
        train_batch = _factory_batches(spec, mb, "train")
        eval_batch = _factory_batches(spec, spec.eval_batch_size, "val")
    else:
        train_batch = _synthetic_batch(spec, config, mb, length, head)
        eval_batch = _synthetic_batch(spec, config, spec.eval_batch_size, eval_len, head)
    num_items = t.grad_accum_steps * _supervised(train_batch, policy)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    shared = _shared_parameters(meta_model)
    with mode:
        model = meta_model.to_empty(device="cpu")
        _retie(model, shared)
        opt = build_optimizer(model, t.optimizer)
        for group in opt.param_groups:
            group["foreach"] = foreach  # CUDA's default multi-tensor path, with its temporaries
        device = torch.device("cpu")
        stages: dict[str, StageTrace] = {}
        # Micro batches after the second repeat the second exactly (gradients already live): trace
        # two per update and scale the FLOPs of one by the accumulation.
        traced = min(t.grad_accum_steps, 2)
        ids = [f"s{i}" for i in range(mb)]
        # The loop holds its inputs too: the whole window on the CPU (fetched before the forward),
        # one micro batch at a time on an accelerator (moved just before its forward).
        held = t.grad_accum_steps if target == "cpu" else 1
        for stage in ("first_step", "steady_step"):
            with CategoryTracker(model, opt, fake=True, round_to=ROUND) as tracker:
                inputs = [_clone(train_batch) for _ in range(held)]
                model.train()
                for k in range(traced):
                    window_backward(model, [(ids, inputs[min(k, held - 1)])], policy, device, t.precision,
                                    num_items=num_items, stats=False)
                before = tracker.live_bytes
                opt.step()
                opt.zero_grad(set_to_none=True)
            stages[stage] = StageTrace(tracker.peak_bytes, tracker.peak_rounded, dict(tracker.peak_breakdown),
                                       tracker.tensors, 0, _seq(train_batch), mb,
                                       optimizer_step_extra_bytes=max(0, tracker.step_peak - before))
        # FLOPs in separate passes: FlopCounterMode keeps tensors alive (the recomputed ones under
        # activation checkpointing), which would inflate a peak measured at the same time.
        counter = FlopCounterMode(display=False)
        with counter:
            window_backward(model, [(ids, _clone(train_batch))], policy, device, t.precision, num_items=num_items,
                            stats=False)
        model.zero_grad(set_to_none=True)
        for stage in ("first_step", "steady_step"):
            stages[stage].flops = counter.get_total_flops() * t.grad_accum_steps
        with CategoryTracker(model, opt, fake=True, round_to=ROUND) as tracker:
            model.eval()
            with torch.no_grad(), autocast_for(device, t.precision):
                model(**_clone(eval_batch))
        counter = FlopCounterMode(display=False)
        with counter, torch.no_grad(), autocast_for(device, t.precision):
            model(**_clone(eval_batch))
        stages["eval"] = StageTrace(tracker.peak_bytes, tracker.peak_rounded, dict(tracker.peak_breakdown),
                                    tracker.tensors, counter.get_total_flops(), _seq(eval_batch),
                                    int(eval_batch["input_ids"].shape[0]) if "input_ids" in eval_batch else spec.eval_batch_size)
        params = list({id(p): p for p in model.parameters()}.values())
        n_params = sum(p.numel() for p in params)
        trainable = sum(p.numel() for p in params if p.requires_grad)
        param_bytes = sum(p.numel() * p.element_size() for p in params)
        grad_bytes = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
        opt_bytes = sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
                        if isinstance(v, torch.Tensor))
        buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    max_pos = getattr(config, "max_position_embeddings", None) if config is not None else None
    return TraceResult(stages=stages, parameters=n_params, grad_accum_steps=t.grad_accum_steps, max_positions=max_pos, trainable_parameters=trainable, parameter_bytes=param_bytes,
                       gradient_bytes=grad_bytes, optimizer_state_bytes=opt_bytes, buffer_bytes=buffer_bytes,
                       largest_layer_bytes=layer_bytes, largest_layer=layer_name, layers=layers, foreach=foreach,
                       precision=t.precision, activation_checkpointing=bool(ac), seconds=time.perf_counter() - t0,
                       notes=notes)


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


def _supervised(batch: dict, policy) -> int:
    """Counted on the real input tensors (before they meet fake ones)."""
    labels = batch["labels"]
    if policy.shift_labels and labels.ndim >= 2:
        labels = labels[..., 1:]
    return int((labels != -100).sum())


def _clone(batch: dict) -> dict:
    """The batch as the loop holds it: allocated inside the trace (fake), so its bytes are counted."""
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


def _seq(batch: dict) -> int:
    ids = batch.get("input_ids")
    return int(ids.shape[1]) if isinstance(ids, torch.Tensor) and ids.ndim >= 2 else 0


@contextlib.contextmanager
def _quiet():
    import logging

    logger = logging.getLogger("transformers")
    old = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(old)
