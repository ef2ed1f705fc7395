"""train.precision: bf16-true-autocast — bf16 weights (as bf16-true) with bf16 autocast over them, as the Trainer's
bf16=True, accelerate's mixed_precision="bf16" and Lightning's "bf16-mixed" run a model loaded in bf16.

pilotrun's loop builds and runs it, the trace matches that loop on this CPU under the same tracker, a GPU target's
trace holds what CUDA's autocast keeps in fp32 (estimate/autocast_lists.py), describe reads it from a program's
objects, and the handle, the catalog and `variants` accept it.
"""
from __future__ import annotations

import pytest
import torch

from pilotrun.config import SpecError, load_spec
from pilotrun.estimate.autocast_lists import cuda_autocast_lists
from pilotrun.estimate.trace import _synthetic_batch, trace_job
from pilotrun.measure.tensors import CategoryTracker
from pilotrun.models.loading import build_model
from pilotrun.models.quiet import QuietTransformers
from pilotrun.train.batches import autocast_for, supervised_count
from pilotrun.train.loss import decide_loss_policy, window_backward
from pilotrun.train.optim import build_optimizer
from tests.conftest import EXAMPLES

TINY = EXAMPLES / "tiny-sft" / "pilot.yaml"
# A LayerNorm model whose eager attention calls softmax without a dtype: what CUDA's fp32 list changes.
GPT2 = ["model.config={model_type: gpt2, vocab_size: 512, n_embd: 64, n_layer: 2, n_head: 4, n_positions: 128, "
        "pad_token_id: 0}", "model.attn_implementation=eager"]


def spec_of(precision: str, *sets: str):
    return load_spec(TINY, ["train.grad_accum_steps=1", f"train.precision={precision}", *sets], check_files=False)


def traced(spec, target: str) -> dict:
    with QuietTransformers():
        return trace_job(spec, target=target).to_dict()


def measured(spec) -> dict:
    """Peak live tensor bytes of two real updates of pilotrun's loop (build_model, the optimizer, window_backward
    under the precision's autocast), as tests/estimate/test_estimate_adapters.py measures the other precisions."""
    loaded = build_model(spec.model, spec.build_context())
    model = loaded.model
    opt = build_optimizer(model, spec.train.optimizer, torch.device("cpu"))
    policy = decide_loss_policy(model, "auto")
    batch = _synthetic_batch(spec, loaded.config, spec.train.micro_batch_size, spec.data.max_length, "causal-lm")
    batch["attention_mask"][:, -3:] = 0
    n = supervised_count(batch, policy.shift_labels)
    out = {}
    for stage in ("first_step", "steady_step"):
        with CategoryTracker(model, opt, round_to=0) as tracker:
            model.train()
            window_backward(model, [(["a"], {k: v.clone() for k, v in batch.items()})], policy, torch.device("cpu"),
                            spec.train.precision, num_items=n, stats=False)
            opt.step()
            opt.zero_grad(set_to_none=True)
        out[stage] = tracker.peak_bytes
    return out


def test_the_loop_holds_bf16_weights_and_autocasts_over_them():
    spec = spec_of("bf16-true-autocast")
    loaded = build_model(spec.model, spec.build_context())
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    assert any("bf16 autocast over them" in n for n in loaded.notes)
    ctx = autocast_for(torch.device("cpu"), "bf16-true-autocast")
    assert isinstance(ctx, torch.autocast) and ctx.fast_dtype == torch.bfloat16
    assert not isinstance(autocast_for(torch.device("cpu"), "bf16-true"), torch.autocast)
    # A LoRA adapter on the bf16 base: peft's default fp32 adapter, as a program that calls get_peft_model has it.
    lora = spec_of("bf16-true-autocast", "model.adapter={r: 4, target_modules: [q_proj, v_proj]}")
    model = build_model(lora.model, lora.build_context()).model
    dtypes = {("lora_" in n, p.dtype) for n, p in model.named_parameters()}
    assert dtypes == {(True, torch.float32), (False, torch.bfloat16)}


@pytest.mark.parametrize("case", ["llama", "gpt2 eager"])
def test_the_trace_matches_the_loop_on_this_cpu(case):
    spec = spec_of("bf16-true-autocast", *(GPT2 if case == "gpt2 eager" else []))
    trace = traced(spec, "cpu")
    with QuietTransformers():
        real = measured(spec)
    for stage in ("first_step", "steady_step"):
        est = trace["stages"][stage]["peak_bytes"]
        assert abs(est / real[stage] - 1) < 0.01, (stage, est, real[stage])
    assert trace["precision"] == "bf16-true-autocast"


def test_a_gpu_target_holds_what_cuda_autocast_keeps_in_fp32():
    true, auto = (traced(spec_of(p, *GPT2), "cuda") for p in ("bf16-true", "bf16-true-autocast"))
    # The same weights, gradients and optimizer state (no fp32 master copy: half of bf16's fp32 weights).
    for key in ("parameter_bytes", "gradient_bytes", "optimizer_state_bytes"):
        assert auto[key] == true[key]
    assert auto["parameter_bytes"] * 2 == traced(spec_of("bf16", *GPT2), "cuda")["parameter_bytes"]
    # More activations: the eager softmax keeps fp32 probabilities (4 bytes each, per layer) beside the bf16 copy
    # the next matmul saves, and the norms' outputs are fp32.
    mb, heads, length, layers = 8, 4, 96, 2
    probs_fp32 = layers * mb * heads * length * length * 4
    for stage in ("first_step", "steady_step"):
        extra = auto["stages"][stage]["peak_bytes"] - true["stages"][stage]["peak_bytes"]
        assert probs_fp32 <= extra < 3 * probs_fp32, (stage, extra, probs_fp32)
    # On a CPU target the CPU's own lists run: softmax and layer_norm stay in bf16, as they do there.
    cpu_true, cpu_auto = (traced(spec_of(p, *GPT2), "cpu") for p in ("bf16-true", "bf16-true-autocast"))
    assert cpu_auto["stages"]["steady_step"]["peak_bytes"] == cpu_true["stages"]["steady_step"]["peak_bytes"]


def test_cuda_fp32_list_applies_under_autocast_only_and_is_put_back():
    x = torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True)
    norm = torch.nn.LayerNorm(8).to(torch.bfloat16)
    softmax = torch.Tensor.softmax
    with cuda_autocast_lists("cuda"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.nn.functional.softmax(x, -1).dtype == torch.float32
            assert x.softmax(-1).dtype == torch.float32 and (x ** 2).dtype == torch.float32
            assert norm(x).dtype == torch.float32
            assert torch.nn.functional.softmax(x, -1, dtype=torch.bfloat16).dtype == torch.bfloat16  # explicit dtype
            assert (x @ x.T).dtype == torch.bfloat16   # the lower-precision list is untouched
            # The recompute of checkpointing (in backward, where a TorchFunctionMode is not active) meets the same ops.
            y = torch.utils.checkpoint.checkpoint(lambda t: norm(t).softmax(-1), x, use_reentrant=False)
        y.sum().backward()
        assert x.grad is not None and torch.nn.functional.softmax(x, -1).dtype == torch.bfloat16  # autocast off
    assert torch.Tensor.softmax is softmax and "softmax" not in vars(torch.Tensor)
    with cuda_autocast_lists("cpu"), torch.autocast("cpu", dtype=torch.bfloat16):
        assert x.softmax(-1).dtype == torch.bfloat16


def test_describe_reads_it_from_each_framework():
    from pilotrun.integrations.accelerate import MIXED_PRECISION
    from pilotrun.program.describe import LIGHTNING_PRECISION, describe_objects

    def model(dtype):
        from transformers import GPT2Config, GPT2LMHeadModel

        return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=32)).to(dtype)

    half, full = model(torch.bfloat16), model(torch.float32)
    said = {"Trainer(precision='bf16-mixed')": LIGHTNING_PRECISION["bf16-mixed"],
            "Accelerator(mixed_precision='bf16')": MIXED_PRECISION["bf16"]}
    for source, precision in said.items():
        facts = describe_objects(half, precision=precision, precision_source=source)
        assert facts.precision == "bf16-true-autocast"
        assert facts.precision_source == f"the parameters are bfloat16 and {source} autocasts over them"
        assert describe_objects(full, precision=precision, precision_source=source).precision == "bf16"
    lightning_true = describe_objects(half, precision=LIGHTNING_PRECISION["bf16-true"], precision_source="x")
    assert lightning_true.precision == "bf16-true"


def test_the_handle_catalog_and_variants_accept_it():
    from pilotrun.estimate.catalog import load_catalog
    from pilotrun.program.handle import _check_description
    from pilotrun.variants.define import plan_variants

    _check_description({"precision": "bf16-true-autocast"})
    with pytest.raises(ValueError, match="bf16-true-autocast"):
        _check_description({"precision": "bf16-mixed"})
    h100 = load_catalog()["H100-80GB"]
    peak = h100.peak_flops("bf16")
    assert peak and h100.peak_flops("bf16-true-autocast") == peak
    control = spec_of("fp32")
    assert "bf16-true-autocast" not in [v.name for v in plan_variants(control).run]  # runs only when named
    named = plan_variants(spec_of("fp32", "pilot.variants.run=[bf16-true-autocast, bf16-true]"))
    assert [(v.name, v.settings) for v in named.run] == [
        ("bf16-true-autocast", {"train.precision": "bf16-true-autocast"}), ("bf16-true", {"train.precision": "bf16-true"})]
    same = plan_variants(spec_of("bf16-true-autocast", "pilot.variants.run=[bf16-true-autocast]"))
    assert same.skipped[0].why == "the control already trains in bf16-true-autocast"
    with pytest.raises(SpecError, match="pilot.variants.run"):
        spec_of("fp32", "pilot.variants.run=[bf16-autocast]")
