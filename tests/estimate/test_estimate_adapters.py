"""The estimator on adapter, quantised-base, bf16-true and memory-saving-optimizer jobs.

The storage tables (estimate/layouts.py) are checked against real bitsandbytes / torch / transformers objects on
this CPU, and the fake-tensor trace against the same job run for real (peft LoRA, a bitsandbytes 4- or 8-bit base
loaded through transformers, the real optimizer) under the same live-tensor tracker.
"""
from __future__ import annotations

import math
import tempfile

import pytest
import torch

from pilotrun.config import load_spec
from pilotrun.estimate import layouts
from pilotrun.estimate.trace import _synthetic_batch, autocast_precision, trace_job
from pilotrun.measure.tensors import CategoryTracker
from pilotrun.models.loading import ModelError, build_model
from pilotrun.models.quiet import QuietTransformers
from pilotrun.train.batches import supervised_count
from pilotrun.train.loss import decide_loss_policy, window_backward
from pilotrun.train.optim import build_optimizer
from tests.conftest import EXAMPLES, require

bnb = require("bitsandbytes", "bitsandbytes")

TINY = EXAMPLES / "tiny-sft" / "pilot.yaml"


def tiny_spec(*sets: str):
    return load_spec(TINY, ["train.grad_accum_steps=1", *sets], check_files=False)


def _unique_bytes(tensors) -> int:
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def _quant_state_tensors(model) -> list[torch.Tensor]:
    """bitsandbytes keeps a 4-bit layer's absmax/code (and the nested state) on the weight, not as parameters."""
    out = []
    for m in model.modules():
        qs = getattr(getattr(m, "weight", None), "quant_state", None)
        if qs is not None:
            out += [qs.absmax, qs.code] + ([qs.offset, qs.state2.absmax, qs.state2.code] if qs.nested else [])
        scb = getattr(getattr(m, "weight", None), "SCB", None)
        if isinstance(m, bnb.nn.Linear8bitLt) and scb is not None:
            out.append(scb)
    return out


def real_job(spec):
    """The job exactly as the pilot builds it (models.loading.build_model: a bitsandbytes base through
    BitsAndBytesConfig, peft LoRA, bf16-true; train.optim: the optimizer), with real tensors on this CPU."""
    loaded = build_model(spec.model, spec.build_context())
    opt = build_optimizer(loaded.model, spec.train.optimizer, torch.device("cpu"))
    return loaded.model, loaded.config, opt


def measure_real(spec) -> dict:
    """Peak live tensor bytes of two real updates, plus bitsandbytes' quantisation state the tracker cannot see
    (it hangs off the weights, not the module's parameters)."""
    model, config, opt = real_job(spec)
    policy = decide_loss_policy(model, "auto")
    batch = _synthetic_batch(spec, config, spec.train.micro_batch_size, spec.data.max_length, "causal-lm")
    # Padding as in real data: with an all-ones mask the real model skips the mask the fake trace must build.
    batch["attention_mask"][:, -3:] = 0
    n = supervised_count(batch, policy.shift_labels)
    extra = _unique_bytes(_quant_state_tensors(model))
    out = {}
    for stage in ("first_step", "steady_step"):
        with CategoryTracker(model, opt, round_to=0) as tracker:
            model.train()
            window_backward(model, [(["a"], {k: v.clone() for k, v in batch.items()})], policy, torch.device("cpu"),
                            autocast_precision(spec.train.precision), num_items=n, stats=False)
            opt.step()
            opt.zero_grad(set_to_none=True)
        out[stage] = tracker.peak_bytes + extra
    state = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    out["optimizer_state_bytes"] = _unique_bytes(state)
    out["trainable"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return out


CASES = {
    "lora fp32 adamw": ["model.adapter={r: 8, target_modules: [q_proj, v_proj]}"],
    "qlora nf4 bf16 adamw8bit": ["model.adapter={r: 8}", "model.quantization={bits: 4}", "train.precision=bf16",
                                 "train.optimizer.name=adamw8bit"],
    "lora bf16-true adafactor": ["model.adapter={r: 8}", "train.precision=bf16-true", "train.optimizer.name=adafactor"],
    "lora 8-bit base sgd momentum": ["model.adapter={r: 8}", "model.quantization={bits: 8}",
                                     "train.optimizer={name: sgd, lr: 0.1, momentum: 0.9}"],
    "full bf16-true paged_adamw8bit": ["train.precision=bf16-true", "train.optimizer.name=paged_adamw8bit"],
}


@pytest.mark.parametrize("case", list(CASES))
def test_trace_matches_the_real_job_on_cpu(case):
    spec = tiny_spec(*CASES[case])
    with QuietTransformers():
        trace = trace_job(spec, target="cpu").to_dict()
        real = measure_real(spec)
    assert trace["trainable_parameters"] == real["trainable"]
    assert trace["optimizer_state_bytes"] == real["optimizer_state_bytes"]
    for stage in ("first_step", "steady_step"):
        est = trace["stages"][stage]["peak_bytes"]
        assert abs(est / real[stage] - 1) < 0.01, (stage, est, real[stage])


def test_lora_counts_follow_the_hand_formula():
    spec = tiny_spec("model.adapter={r: 4, target_modules: [q_proj, v_proj]}")
    trace = trace_job(spec, target="cuda").to_dict()
    c = spec.model.config
    hidden, heads, kv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    kv_out = hidden // heads * kv
    per_layer = layouts.lora_parameters(4, hidden, hidden) + layouts.lora_parameters(4, hidden, kv_out)
    lora = per_layer * c["num_hidden_layers"]
    a = trace["adaptation"]
    assert a["adapter_parameters"] == lora == trace["trainable_parameters"]
    assert trace["gradient_bytes"] == 4 * lora                          # frozen base: no gradients
    # AdamW: two fp32 moments per LoRA value and one fp32 step per LoRA tensor (4 tensors per layer)
    assert trace["optimizer_state_bytes"] == 8 * lora + 4 * 4 * c["num_hidden_layers"]
    steady = trace["stages"]["steady_step"]["breakdown"]
    assert steady["gradients"] <= 4 * lora and steady["optimizer"] >= 8 * lora


def test_quantized_storage_table_matches_bitsandbytes():
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    spec = tiny_spec()
    model = build_model(spec.model, spec.build_context()).model
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        for bits, dq in ((4, True), (4, False), (8, False)):
            cfg = (BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=dq)
                   if bits == 4 else BitsAndBytesConfig(load_in_8bit=True))
            q = AutoModelForCausalLM.from_pretrained(tmp, quantization_config=cfg, device_map="cpu")
            layers = [m for m in q.modules() if isinstance(m, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))]
            assert layers
            for m in layers:
                real = _unique_bytes([m.weight, *_quant_state_tensors(m)])
                table = sum(p.bytes for p in layouts.quantized_linear(bits, m.out_features, m.in_features, dq))
                assert real == table, (bits, dq, m)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_optimizer_state_table_matches_the_real_optimizers(dtype):
    from transformers.optimization import Adafactor

    shapes = [(256, 300), (100,), (64, 64), (4097,), (16, 48)]
    build = {
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        "adamw8bit": lambda ps: bnb.optim.AdamW8bit(ps, lr=1e-3),
        "paged_adamw8bit": lambda ps: bnb.optim.PagedAdamW8bit(ps, lr=1e-3),
        "adafactor": lambda ps: Adafactor(ps, lr=1e-3, beta1=None, relative_step=False, scale_parameter=False,
                                          warmup_init=False),
    }
    name_of = {torch.float32: "fp32", torch.bfloat16: "bf16"}
    for name, make in build.items():
        params = [torch.nn.Parameter(torch.randn(s, dtype=dtype)) for s in shapes]
        opt = make(params)
        for p in params:
            p.grad = torch.randn_like(p)
        with pytest.warns(UserWarning) if name == "paged_adamw8bit" else _nothing():
            opt.step()
        real = _unique_bytes([v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)])
        predicted = layouts.optimizer_state_bytes(name, [(s, name_of[dtype]) for s in shapes], momentum=0.9)
        assert real == predicted, name
    # the rule of thumb: 8-bit AdamW ~ 2 bytes per value plus 2 x fp32 per 256 values
    assert layouts.optimizer_state_bytes("adamw8bit", [((4096, 4096), "bf16")]) == \
        2 * 4096 * 4096 + 2 * 4 * math.ceil(4096 * 4096 / 256) + 2 * 256 * 4


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_adapter_on_missing_modules_names_the_linear_modules():
    spec = tiny_spec("model.adapter={r: 4, target_modules: [query, value]}")
    with pytest.raises(ModelError) as err:
        trace_job(spec, target="cuda")
    assert err.value.field == "model.adapter.target_modules"
    msg = str(err.value)
    assert "model.adapter.target_modules" in msg and "q_proj" in msg and "all-linear" in msg


# -- what estimate, select, plan and the advisor do with adapter jobs ---------------------------------------------

def test_adapter_view_plan_and_merged_export():
    from pilotrun.estimate.experiments import adapter_line, adapter_view
    from pilotrun.estimate.plan import pipeline_hours

    spec = tiny_spec("model.adapter={r: 4}", "export.merge=true")
    trace = trace_job(spec, target="cuda").to_dict()
    view = adapter_view(trace, spec)
    assert view is not None
    base = trace["adaptation"]["base_parameters"]
    assert view["parameters"] == base + view["trainable_parameters"]
    assert view["trainable_share"] == pytest.approx(view["trainable_parameters"] / view["parameters"])
    assert view["adapter_bytes"] == 4 * view["trainable_parameters"]
    assert view["checkpoint_bytes"] == view["adapter_bytes"] + trace["optimizer_state_bytes"]
    assert view["merged_export"]["bytes"] == 4 * base          # fp32 base, adapter merged in
    assert "merged export" in adapter_line(view) and "trainable of" in adapter_line(view)
    row = {"seconds_per_update": 1.0, "utilisation_source": "test", "gpus": 1, "price_per_gpu_hour": None}
    items = {i["item"]: i for i in pipeline_hours(spec, row, trace)["items"]}
    assert "adapter weights" in items["export"]["from"]
    assert "merged export (export.merge)" in items
    # checkpoints hold the adapter and its optimizer state, not the frozen base
    assert f"{view['checkpoint_bytes'] / 1e9:.1f} GB" in items["checkpoints"]["from"]
    assert adapter_view(trace_job(tiny_spec(), target="cuda").to_dict(), tiny_spec()) is None


def test_other_experiments_are_labelled_and_never_advised():
    from pilotrun.estimate.advise import FIX_KEYS, combinations, evaluate
    from pilotrun.estimate.catalog import load_catalog
    from pilotrun.estimate.experiments import other_experiments

    spec = tiny_spec()
    others = other_experiments(spec)
    assert [o.model.adapter is not None for _, o in others] == [True, True]
    assert all(label.startswith("a different experiment: ") for label, _ in others)
    assert "QLoRA" in others[1][0] and others[1][1].model.quantization.bits == 4
    assert other_experiments(others[0][1]) == []                   # an adapter job has no "other" adapter row

    # Every combination the advisor can offer changes only the fix order's keys: no adapter, no quantisation.
    class Stub:
        def __init__(self, trace):
            self.trace = trace

        def get(self, ac=None, precision=None):
            return self.trace

    trace = trace_job(spec, target="cuda").to_dict()
    catalog = load_catalog()
    acc = catalog["A100-80GB"]
    for c in combinations(spec, acc, "single", 1, catalog):
        row = evaluate(spec, Stub(trace), c, "single", None, None)
        assert set(row.changes) <= FIX_KEYS and not any(k.startswith("model.") for k in row.changes)


@pytest.mark.process
def test_select_lists_adapter_experiments_beside_the_full_fine_tune(tmp_path):
    import json

    from tests.conftest import pilotrun_cli

    r = pilotrun_cli("select", str(TINY), "--accelerator", "A100-80GB", "--other-experiments", "--json",
                     cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["rows"]
    assert [row["experiment"].split(":")[0] for row in rows] == ["full fine-tune", "a different experiment",
                                                                 "a different experiment"]
    full, lora, qlora = rows
    assert full["adapter"] is None and lora["adapter"]["trainable_share"] < 0.5
    assert qlora["adapter"]["quantized_layers"] > 0
    bad = pilotrun_cli("estimate", str(TINY), "--set", "model.adapter={r: 4, target_modules: [query]}",
                       "--accelerator", "A100-80GB", cwd=tmp_path)
    assert bad.returncode == 2 and "model.adapter.target_modules" in bad.stderr and "q_proj" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_the_report_shows_an_adapter_jobs_split_and_export():
    from pilotrun.ledger.records import GateRow
    from pilotrun.report.html import _adapter_section

    load = {"gate": "load", "verdict": "pass", "reason": "", "details": {
        "parameters": 1_000_000, "trainable_parameters": 5_000, "trainable_bytes": 20_000, "frozen_bytes": 3_980_000}}
    export = {"gate": "export", "verdict": "pass", "seconds": 2.0,
              "reason": "adapter_model.safetensors; merged model in merged/ (3.8 MiB)", "details": {"merged": True}}
    html = _adapter_section([GateRow.from_mapping(load), GateRow.from_mapping(export)])
    assert "<h2>Adapter</h2>" in html and "5,000 of 1,000,000 (0.50%)" in html
    assert "19.5 KiB" in html and "merged model in merged/" in html
    full = dict(load, details={"parameters": 10, "trainable_parameters": 10})
    assert _adapter_section([GateRow.from_mapping(full), GateRow.from_mapping(export)]) == ""            # a full fine-tune has no adapter section
