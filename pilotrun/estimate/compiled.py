"""A torch.compile'd job in the estimate: what the compiled graph saves for backward, and its fused element-wise work.

Inductor hands each graph dynamo captures to AOT autograd, which traces forward and backward as one joint graph and
splits it with the min-cut rematerialization partitioner
(``torch._functorch.partitioners.min_cut_rematerialization_partition``): cheap element-wise intermediates are
recomputed in backward instead of saved, so the forward keeps fewer bytes than eager autograd does. Inductor then
fuses each chain of element-wise and reduction ops into one kernel that reads the chain's inputs and writes the
outputs other kernels use, not every op's.

The trace (``trace.py``, under the same fake mode, autocast lists and attention model as the eager trace) captures
the inputs of one repeated block (``models.structure.largest_block``), and :func:`compiled_facts` runs that block

* eagerly under ``saved_tensors_hooks``: the storages autograd saves (:func:`saved_bytes`; parameters, their
  autocast casts -- the trace's ``weight_casts`` -- buffers and the block's inputs excepted), and under
  ``ops.OpCosts``: the bytes its zero-FLOP ops move forward and backward, as the trace counts them;
* through ``aot_function`` with inductor's decompositions and the min-cut partitioner (:func:`partitioned_block`):
  the forward graph's outputs past the user's are what the compiled block saves (the same exceptions), and the
  fused element-wise bytes: each group of connected element-wise/reduction nodes of the partitioned forward and
  backward graphs (the min-cut's recompute included) one kernel, reading what enters the group and writing what
  leaves it.

On a real tiny Llama on this CPU the fake count equals, to the byte, what ``torch.compile(backend=
"aot_eager_decomp_partition")`` (the same partitioner and decompositions) saves
(tests/estimate/test_estimate_compiled.py).
What is not modelled: the transient buffers fused kernels no longer allocate (the peak's temporaries in backward),
inductor's own choices beyond the partitioner (its scheduler may fuse less across reductions), and CUDA graphs.

The estimate (:func:`compiled_trace`) takes ``layers x (eager - compiled saved bytes)`` off the training stages'
activations (the whole difference at a moment holding at least the eager saved bytes of every layer, a
proportional share at later moments of backward), and ``layers x (eager - fused bytes)`` off the micro batch's
zero-FLOP ops (matmul and attention time unchanged). Both scopes are modelled per block: with ``compile: model``
the embedding, the final norm, the head and the loss are counted as traced eagerly (an upper bound on their
memory and time). With activation checkpointing, compilation's effect on memory is not modelled (the row says so).
Compile time is not a trace quantity: the plan charges what a pilot measured (``plan.py``), else says unknown.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..config.sections import ac_policy
from ..ledger.records import TRAINING_GATES

# What inductor does not fuse into an element-wise kernel: matmuls, convolutions and attention (ops with a FLOP
# formula), ops of other namespaces (the trace's attention model, a library's kernel) and the random generators.
_RANDOM = ("rand", "randn", "bernoulli", "native_dropout", "randint", "normal")
_VIEWS = frozenset({"view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "slice", "select",
                    "unsqueeze", "squeeze", "alias", "as_strided", "detach", "split", "split_with_sizes", "unbind"})


class _Captured(Exception):
    """Stops the forward once the block's inputs are recorded."""


def capture_block_inputs(model: torch.nn.Module, block: torch.nn.Module, forward: Callable[[], Any]) -> tuple:
    """(args, kwargs) the model's ``forward`` hands ``block`` the first time it runs, the forward stopped there. A
    key/value cache is dropped (training keeps none), passed by name or by position (None in its place)."""
    seen: dict[str, tuple] = {}

    def hook(module, args, kwargs):
        seen["call"] = (args, kwargs)
        raise _Captured

    handle = block.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with contextlib.suppress(_Captured), torch.no_grad():
            forward()
    finally:
        handle.remove()
    if "call" not in seen:
        raise RuntimeError(f"the block {type(block).__name__} was not called by the model's forward")
    args, kwargs = seen["call"]
    kept = {k: v for k, v in kwargs.items() if k not in _CACHE_KEYWORDS and not _is_cache(v)}
    # GPT-2 hands its block the cache positionally: kept, each later call would append to it (the compiled block
    # then saw keys twice as long as its queries).
    return tuple(None if _is_cache(a) else a for a in args), kept


_CACHE_KEYWORDS = ("past_key_values", "past_key_value", "cache", "use_cache")


def _is_cache(value: Any) -> bool:
    return "Cache" in type(value).__name__


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _excluded(block: torch.nn.Module, inputs: list[torch.Tensor]) -> set[int]:
    return {_storage(p) for p in block.parameters()} | {_storage(b) for b in block.buffers()} | \
        {_storage(t) for t in inputs}


def _leaves(args: tuple, kwargs: dict) -> tuple[list, Any, list[int]]:
    leaves, spec = tree_flatten((list(args), kwargs))
    return leaves, spec, [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]


def _with_grad_input(leaves: list, where: list[int]) -> list[torch.Tensor]:
    """The block's tensor inputs, floating ones (the hidden states) requiring grad as inside the model."""
    out = []
    for i in where:
        t = leaves[i].detach()
        out.append(t.requires_grad_(True) if t.is_floating_point() and t.dim() >= 3 else t)
    return out


class _WeightCasts(TorchDispatchMode):
    """Records the storages of copies of ``params``' storages (autocast's lower-precision weight casts): the trace
    counts them as ``weight_casts``, not activations, so neither side of the comparison counts them."""

    def __init__(self, params: set[int]) -> None:
        super().__init__()
        self.params = params
        self.casts: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and isinstance(out, torch.Tensor) and _storage(args[0]) in \
                self.params:
            self.casts.add(_storage(out))
        return out


def saved_bytes(block: torch.nn.Module, args: tuple, kwargs: dict, weight_casts: bool = True) -> int:
    """Bytes of the storages autograd saves in one call of ``block``, parameters, their autocast copies, buffers and
    the inputs excepted: what the call adds to the activations until its backward. ``weight_casts=False`` skips the
    dispatch mode that tells the casts apart (under it dynamo would not compile a compiled ``block``)."""
    leaves, spec, where = _leaves(args, kwargs)
    tensors = _with_grad_input(leaves, where)
    for i, t in zip(where, tensors):
        leaves[i] = t
    a, k = tree_unflatten(leaves, spec)
    skip = _excluded(block, tensors)
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if _storage(t) not in skip:
            seen[_storage(t)] = t.untyped_storage().nbytes()
        return t

    casts = _WeightCasts({_storage(p) for p in block.parameters()})
    telling = casts if weight_casts else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), telling:
        block(*a, **k)
    return sum(b for st, b in seen.items() if st not in casts.casts)


def eager_elementwise_bytes(block: torch.nn.Module, args: tuple, kwargs: dict) -> int:
    """Bytes the zero-FLOP ops of one eager forward and backward of ``block`` move, counted as the trace counts
    them (ops.OpCosts): what fusion can save is measured against the same rows it is taken off."""
    from .ops import OpCosts

    leaves, spec, where = _leaves(args, kwargs)
    tensors = _with_grad_input(leaves, where)
    for i, t in zip(where, tensors):
        leaves[i] = t
    a, k = tree_unflatten(leaves, spec)
    with OpCosts() as costs:
        out = next(t for t in tree_flatten(block(*a, **k))[0] if isinstance(t, torch.Tensor))
        out.backward(torch.ones_like(out))
    for p in block.parameters():
        p.grad = None
    return sum(b * n for _, f, b, n in costs.rows() if not f)


def _name(node) -> str:
    return str(getattr(node.target, "__name__", node.target)).split(".")[0]


def _fusible(node) -> bool:
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    from torch.utils.flop_counter import flop_registry

    packet = node.target.overloadpacket
    namespace, _, name = str(packet).partition(".")
    if namespace not in ("aten", "prims"):   # prims: the casts inductor's decompositions leave
        return False
    return packet not in flop_registry and not any(name.startswith(r) for r in _RANDOM)


def _nbytes(node) -> int:
    vals = [v for v in tree_flatten(node.meta.get("val"))[0] if isinstance(v, torch.Tensor)]
    return sum(v.numel() * v.element_size() for v in vals)


def _inputs(node) -> list:
    return [a for a in node.all_input_nodes if a.op != "get_attr"]


def _real_users(node) -> Iterator:
    """The users of ``node``, looking through views (a view's users read the node's storage)."""
    for u in node.users:
        if _fusible(u) and _name(u) in _VIEWS:
            yield from _real_users(u)
        else:
            yield u


def eager_pointwise_bytes(graph) -> int:
    """Bytes each fusible op of ``graph`` moves when run one op at a time: its distinct inputs read and its output
    written (views move nothing), as ops.OpCosts counts an eager op."""
    return sum(sum(_nbytes(a) for a in _inputs(n)) + _nbytes(n) for n in graph.nodes
               if _fusible(n) and _name(n) not in _VIEWS)


def fused_pointwise_bytes(graph) -> int:
    """Bytes the fusible ops of ``graph`` move when each connected group of them is one kernel: what enters the
    group read once, what leaves it (used by another kernel or returned) written once."""
    group: dict = {}

    def root(n):
        while group[n] is not n:
            group[n] = group[group[n]]
            n = group[n]
        return n

    fusible = [n for n in graph.nodes if _fusible(n)]
    for n in fusible:
        group[n] = n
    for n in fusible:
        for a in _inputs(n):
            if a in group:
                group[root(a)] = root(n)
    members: dict = {}
    for n in fusible:
        members.setdefault(root(n), []).append(n)
    total = 0
    for nodes in members.values():
        inside = set(nodes)
        if all(_name(n) in _VIEWS for n in nodes):
            continue   # only aliases: no kernel
        entering = {a for n in nodes for a in _inputs(n) if a not in inside}
        leaving = {n for n in nodes if _name(n) not in _VIEWS and any(u not in inside for u in _real_users(n))}
        total += sum(_nbytes(a) for a in entering) + sum(_nbytes(n) for n in leaving)
    return total


def _base(node):
    """The node whose storage ``node`` aliases (through views)."""
    while node.op == "call_function" and _name(node) in _VIEWS and node.all_input_nodes:
        node = node.all_input_nodes[0]
    return node


_CASTS = frozenset({"_to_copy", "convert_element_type"})


def _saved_by_forward(fw_module, num_fwd_outputs: int, num_params: int) -> int:
    """Bytes of the forward graph's outputs kept for backward: past the user's outputs, each storage once, inputs
    (the first ``num_params`` are the parameters, then the block's inputs), their views and the parameters' casts
    (counted as weight casts, not activations, as saved_bytes does) excepted."""
    outputs = next(iter(fw_module.graph.find_nodes(op="output"))).args[0]
    params = set(list(fw_module.graph.find_nodes(op="placeholder"))[:num_params])
    total = 0
    for b in {_base(n) for n in outputs[num_fwd_outputs:] if hasattr(n, "op")}:
        val = b.meta.get("val")
        if b.op == "placeholder" or not isinstance(val, torch.Tensor):
            continue
        if _name(b) in _CASTS and _base(b.all_input_nodes[0]) in params:
            continue
        total += val.untyped_storage().nbytes()
    return total


def partitioned_block(block: torch.nn.Module, args: tuple, kwargs: dict) -> dict:
    """One call of ``block`` (its parameters and inputs fake tensors) through AOT autograd as inductor runs it
    (inductor's decompositions, the min-cut partitioner): the bytes its forward saves for backward, and the
    element-wise bytes of its forward and backward eager (the joint graph) and fused (the partitioned graphs)."""
    from torch._functorch.aot_autograd import aot_function, make_boxed_func
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.func import functional_call

    names = [n for n, _ in block.named_parameters()]
    params = [p for _, p in block.named_parameters()]
    leaves, spec, where = _leaves(args, kwargs)
    facts: dict[str, int] = {}

    def partition(joint, joint_inputs, **kw):
        fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, **kw)
        facts["saved_bytes"] = _saved_by_forward(fw, kw["num_fwd_outputs"], len(params))
        facts["eager_pointwise_bytes"] = eager_pointwise_bytes(joint.graph)
        facts["fused_pointwise_bytes"] = fused_pointwise_bytes(fw.graph) + fused_pointwise_bytes(bw.graph)
        return fw, bw

    def run(ps, tensors):
        values = list(leaves)
        for i, t in zip(where, tensors):
            values[i] = t
        a, k = tree_unflatten(values, spec)
        return functional_call(block, dict(zip(names, ps)), tuple(a), k)

    def boxed(gm, _inputs):
        return make_boxed_func(gm)

    compiled = aot_function(run, fw_compiler=boxed, bw_compiler=boxed, partition_fn=partition,
                            decompositions=select_decomp_table())
    tensors = _with_grad_input(leaves, where)
    with unset_fake_temporarily():
        compiled(params, tensors)
    if "saved_bytes" not in facts:
        raise RuntimeError("AOT autograd did not partition the block (no input requires grad)")
    return facts


def compiled_facts(model: torch.nn.Module, block_name: str, layers: int, forward: Callable[[], Any],
                   scope: str, ac: bool | str, context: Callable[[], Any]) -> dict:
    """What the trace records of a compiled job (TraceResult.compiled): per block, the eager and compiled saved
    bytes and the eager and fused element-wise bytes of one micro batch, or why compilation was not modelled.
    ``forward`` runs the model's forward as the loop does; ``context`` gives the autocast it runs under."""
    if scope == "off":
        return {}
    if ac_policy(ac) is not None:
        return {"scope": scope, "modelled": False,
                "why": "with activation checkpointing the compiled graph's saved tensors and fused kernels are not "
                       "modelled"}
    block = model if layers == 0 else model.get_submodule(block_name)
    try:
        with context():
            args, kwargs = capture_block_inputs(model, block, forward)
            eager = saved_bytes(block, args, kwargs)
            elementwise = eager_elementwise_bytes(block, args, kwargs)
            part = partitioned_block(block, args, kwargs)
    except Exception as exc:   # a block AOT autograd cannot trace (a library's kernel): said in the row, not fatal
        return {"scope": scope, "modelled": False, "why": f"AOT autograd could not trace {block_name}: "
                f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"}
    return {"scope": scope, "modelled": True, "block": block_name, "layers": max(1, layers),
            "eager_saved_bytes": eager, "compiled_saved_bytes": part["saved_bytes"],
            "eager_pointwise_bytes": elementwise, "aot_pointwise_bytes": part["eager_pointwise_bytes"],
            "fused_pointwise_bytes": part["fused_pointwise_bytes"]}


def _less_activations(breakdown: dict, eager: int, saved: int) -> dict:
    """``breakdown`` with the compiled graph's saving off its activations: all of it at a moment that holds at least
    every layer's eager saved bytes, a proportional share at a later moment of backward (fewer layers' held)."""
    acts = breakdown.get("activations", 0)
    if not acts or not eager:
        return breakdown
    return {**breakdown, "activations": max(0, acts - int(saved * min(1.0, acts / eager)))}


def fused_ops(ops: list[list], fused_bytes: int) -> list[list]:
    """One micro batch's ``ops`` ([dtype, flops, bytes, count]) with ``fused_bytes`` fewer bytes moved by its
    zero-FLOP (element-wise, reduction, copy) rows, spread over them in proportion to their bytes: what fusing the
    layers' element-wise chains saves, matmul and attention rows unchanged."""
    total = sum(b * n for _, f, b, n in ops if not f)
    if not total or not fused_bytes:
        return ops
    keep = max(0.0, 1.0 - fused_bytes / total)
    return [[d, f, b if f else int(b * keep), n] for d, f, b, n in ops]


def compiled_trace(trace: dict) -> dict:
    """The trace as the compiled job runs it (training stages' activations and element-wise ops, see the module);
    the trace itself when compilation is off, not modelled, or already applied."""
    facts = trace.get("compiled") or {}
    if not facts.get("modelled") or trace.get("compiled_applied"):
        return trace
    layers = int(facts.get("layers") or 1)
    eager = int(facts["eager_saved_bytes"]) * layers
    saved = max(0, eager - int(facts["compiled_saved_bytes"]) * layers)
    fused = max(0, int(facts["eager_pointwise_bytes"]) - int(facts["fused_pointwise_bytes"])) * layers
    stages = dict(trace["stages"])
    for name in TRAINING_GATES:
        st = stages[name]
        peak = _less_activations(st["breakdown"], eager, saved)
        cut = st["breakdown"].get("activations", 0) - peak.get("activations", 0)
        phases = {p: [{"bytes": sum(b.values()), "breakdown": b}
                      for b in (_less_activations(m["breakdown"], eager, saved) for m in moments)]
                  for p, moments in (st.get("phases") or {}).items()}
        stages[name] = {**st, "breakdown": peak, "phases": phases, "peak_bytes": st["peak_bytes"] - cut,
                        "peak_bytes_rounded": st["peak_bytes_rounded"] - cut, "ops": fused_ops(st.get("ops") or [],
                                                                                                fused)}
    return {**trace, "stages": stages, "compiled_applied": True}


def note(trace: dict) -> tuple[int, str]:
    """The estimate row's correction for a compiled job: (bytes less than eager per micro batch, what was modelled);
    (0, "") when compilation is off."""
    facts = trace.get("compiled") or {}
    if not facts:
        return 0, ""
    scope = facts.get("scope", "?")
    if not facts.get("modelled"):
        return 0, f"compiled ({scope}): not modelled -- {facts.get('why')}; the eager trace's memory and time used"
    layers = int(facts.get("layers") or 1)
    eager, comp = int(facts["eager_saved_bytes"]), int(facts["compiled_saved_bytes"])
    ew, fw = int(facts["eager_pointwise_bytes"]), int(facts["fused_pointwise_bytes"])
    less = max(0, eager - comp) * layers
    outside = ("; the embedding, final norm, head and loss counted as eager (an upper bound)" if scope == "model"
               else "")
    return less, (f"compiled ({scope}): saved activations from AOT autograd's min-cut partitioner, "
                  f"{less / 2**30:.3g} GiB less than eager per micro batch ({comp / 2**20:.3g} MiB instead of "
                  f"{eager / 2**20:.3g} MiB per {facts.get('block')} x {layers}); pointwise chains fused: each "
                  f"layer's element-wise traffic {fw / 2**20:.3g} MiB instead of {ew / 2**20:.3g} MiB (connected "
                  f"element-wise and reduction ops one kernel, the partitioner's recompute included), taken off the "
                  f"step's zero-FLOP ops; matmul and attention time unchanged; compile time charged per process "
                  f"start in the plan{outside}")
