"""The attention kernel the target runs: the trace keeps what that kernel keeps, whatever the CPU would dispatch."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from pilotrun.config import load_spec
from pilotrun.estimate.model import attention_note
from pilotrun.models.attention import flash_attention, model_target_attention
from pilotrun.models.loading import ModelError, build_model
from tests.conftest import EXAMPLES, FIXTURES, pilotrun_cli

# GPT-BigCode (santacoder's architecture) with multi-query attention: transformers' sdpa path hands CPU SDPA inputs
# its flash kernel refuses, so the CPU runs the math path and keeps L x L scores; a CUDA target runs flash.
BIGCODE = {"model_type": "gpt_bigcode", "vocab_size": 512, "n_embd": 64, "n_head": 4, "n_layer": 2,
           "n_positions": 1024, "multi_query": True}


@pytest.mark.parametrize("causal", [True, False])
def test_the_modelled_kernel_computes_what_sdpa_computes(causal):
    torch.manual_seed(0)
    q = torch.randn(2, 4, 16, 8, requires_grad=True)
    k, v = (torch.randn(2, 2, 16, 8, requires_grad=True) for _ in range(2))   # grouped-query: 2 key/value heads
    out, lse = flash_attention(q, k, v, causal, 8 ** -0.5)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    assert torch.allclose(out, ref, atol=1e-5) and lse.shape == (2, 4, 16) and lse.dtype == torch.float32
    w = torch.randn_like(out)
    ours = torch.autograd.grad((out * w).sum(), (q, k, v))
    theirs = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for a, b in zip(ours, theirs, strict=True):
        assert torch.allclose(a, b, atol=1e-5)


def _saved_shapes(model, batch, implementation: str | None) -> tuple[list[tuple], object]:
    """Shapes and dtypes of every tensor autograd keeps for backward in one forward."""
    saved: list[tuple] = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype))
        return t

    record = None
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if implementation is None:
            model(**batch).loss.backward()
        else:
            with model_target_attention(implementation, model) as record, record.counting():
                model(**batch).loss.backward()
    return saved, record


def _bigcode(tmp_path, length: int, extra=()):
    spec = load_spec(EXAMPLES / "tiny-sft" / "pilot.yaml", [
        f"model.config={json.dumps(BIGCODE)}", f"data.max_length={length}", *extra], check_files=False)
    return build_model(spec.model, spec.build_context()).model


def test_a_model_whose_cpu_path_is_math_keeps_only_the_flash_kernels_tensors_when_modelled(tmp_path):
    """Issue 42: the santacoder-shaped model's CPU SDPA falls back to math (L x L fp32 scores kept); modelled as the
    target's kernel, every attention call keeps its output and one fp32 logsumexp per query and head, and nothing of
    L x L size is kept anywhere."""
    L, B, H = 48, 2, BIGCODE["n_head"]   # L differs from the hidden size: no activation is L x L by chance
    model = _bigcode(tmp_path, L)
    ids = torch.randint(3, 512, (B, L))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    as_cpu, _ = _saved_shapes(model, batch, None)
    assert any(shape[-2:] == (L, L) for shape, _ in as_cpu), "the CPU path was expected to keep L x L"
    modelled, record = _saved_shapes(model, batch, "sdpa")
    assert not any(shape[-2:] == (L, L) for shape, _ in modelled), modelled
    lse = [s for s in modelled if s == ((B, H, L), torch.float32)]
    assert len(lse) == BIGCODE["n_layer"] == record.calls
    assert record.cpu_kernels == {"math": BIGCODE["n_layer"]}   # what the CPU would have run, said
    note = attention_note(record.to_dict())
    assert "math" in note and "L×L scores kept for backward, which the target does not keep" in note


def test_eager_is_traced_as_the_model_computes_it_and_flash_is_said():
    assert "L×L scores and probabilities kept" in attention_note({"implementation": "eager", "calls": 0})
    flash = attention_note({"implementation": "flash_attention_2", "kernel": "flash-attn", "calls": 24})
    assert "flash-attn package runs on CUDA GPUs only" in flash and "24 attention calls" in flash
    assert "not recorded" in attention_note({})


def test_a_flash_implementation_the_cpu_cannot_run_names_the_field(tmp_path):
    spec = load_spec(EXAMPLES / "tiny-sft" / "pilot.yaml", ["model.attn_implementation=flash_attention_2"],
                     check_files=False)
    with pytest.raises(ModelError) as err:
        build_model(spec.model, spec.build_context())
    assert err.value.field == "model.attn_implementation" and "flash-attn" in str(err.value)
    # The estimator's meta build takes it (the trace models the kernel).
    assert build_model(spec.model, spec.build_context(), meta=True).model is not None


def test_attn_implementation_is_for_transformers_models(tmp_path):
    res = pilotrun_cli("estimate", str(FIXTURES / "toylm" / "pilot.yaml"), "--set",
                       "model.attn_implementation=eager", cwd=tmp_path)
    assert res.returncode == 2 and "model.attn_implementation" in res.stderr, res.stderr


@pytest.mark.process
def test_the_estimate_of_a_gpt_bigcode_job_models_flash_and_grows_linearly_with_length(tmp_path):
    """The estimate says which kernel it modelled and why; with the target's kernel, activations grow with L, not
    L x L (eager, the model's own softmax, keeps far more)."""
    acts = {}
    for impl, L in (("sdpa", 128), ("sdpa", 256), ("eager", 256)):
        res = pilotrun_cli(
            "estimate", str(EXAMPLES / "tiny-sft" / "pilot.yaml"), "--set", f"model.config={json.dumps(BIGCODE)}",
            "--set", f"model.attn_implementation={impl}", "--set", f"data.max_length={L}", "--set",
            f"eval.max_length={L}", "--set", "train.precision=bf16", "--accelerator", "A100-80GB",
            "--strategy", "single", "--no-advice", "--json", cwd=tmp_path, env={"PILOTRUN_CACHE": str(tmp_path)})
        assert res.returncode == 0, res.stderr
        out = json.loads(res.stdout)
        acts[impl, L] = out["stages"]["steady_step"]["breakdown"]["activations"]
        note = next(c["reason"] for c in out["fits"][0]["corrections"] if c["name"] == "attention kernels")
        if impl == "sdpa":
            assert note.startswith("sdpa: modelled as the target runs it, flash or memory-efficient SDPA") and (
                "math" in note), note
    assert acts["sdpa", 256] / acts["sdpa", 128] == pytest.approx(2.0, rel=0.1)
    assert acts["sdpa", 256] < acts["eager", 256] / 1.5   # eager keeps 2 x 4 heads x L x L per layer besides
