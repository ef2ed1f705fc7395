"""FP8 training (issue 43, deliverable 3): train.precision fp8 in pilotrun's loop (torchao float8), the fp8 variant,
the estimator's FP8 time (the converted matmuls at the FP8 peak, their casts added) and the selection sheet's faster
paths (fp8 where the catalog has an FP8 peak, FlashAttention-3 said not modelled on Hopper)."""
from __future__ import annotations

import pytest
import torch

from pilotrun.config import SpecError, load_spec
from pilotrun.estimate.catalog import load_catalog
from pilotrun.estimate.fp8 import EAGER_CAST_BYTES, fp8_ops, fp8_trace, why_none
from pilotrun.estimate.model import estimate_fit
from pilotrun.estimate.select import faster_paths, path_cell
from pilotrun.ledger.records import Verdict
from pilotrun.train.fp8 import (
    Fp8Record,
    choose_linears,
    convert_linears,
    fp8_matmul_problem,
    high_precision_linears,
    linears_in_high_precision,
)
from pilotrun.variants.define import plan_variants
from tests.conftest import EXAMPLES, require
from tests.estimate.test_estimate import synthetic_trace

TINY = EXAMPLES / "tiny-sft" / "pilot.yaml"
SMALL = ["train.micro_batch_size=2", "train.grad_accum_steps=1", "data.max_length=32", "train.device=cpu"]

# One micro batch: a compute-bound bf16 matmul of a converted Linear (4096 x 4096 x 4096: 137 GFLOP, 96 MiB in,
# 32 MiB out), 12 of them, and a memory-bound element-wise op that FP8 leaves alone.
MM = ["bf16", 2 * 4096**3, 3 * 4096 * 4096 * 2, 4096 * 4096 * 2]
OTHER = ["bf16", 0, 1 << 30, 4]


def fp8_synthetic() -> dict:
    trace = synthetic_trace()
    for name in ("first_step", "steady_step"):
        st = trace["stages"][name]
        st["ops"] = [[MM[0], MM[1], MM[2] + MM[3], 12], OTHER]
        st["fp8_ops"] = [[*MM, 12]]
        st["optimizer_ops"] = [["fp32", 0, 1 << 28, 1]]
    trace["fp8"] = {"modelled": True, "linears": 4, "skipped": {"the output head": 1}}
    return trace


class _Traces:
    def lengths(self):
        return None


def test_fp8_time_counts_the_converted_matmuls_at_the_fp8_peak_with_their_casts():
    cat = load_catalog()
    h100, a100 = cat["H100-80GB"], cat["A100-80GB"]
    rows = fp8_ops([[MM[0], MM[1], MM[2] + MM[3], 12], OTHER], [[*MM, 12]], "eager")
    elements = MM[2] // 2
    assert ["fp8", MM[1], elements + MM[3], 12] in rows          # float8 operands (1 byte), bf16 output
    assert ["bf16", 0, elements * EAGER_CAST_BYTES, 12] in rows   # torchao's eager casts of both operands
    assert OTHER in rows and not any(r[0] == "bf16" and r[1] for r in rows)
    with pytest.raises(ValueError, match="subset"):
        fp8_ops([OTHER], [[*MM, 1]], "eager")

    trace = fp8_synthetic()
    bf16 = estimate_fit(trace, h100, "single", 1)["time"]
    fp8 = estimate_fit(trace, h100, "single", 1, precision="fp8")["time"]
    fused = estimate_fit(fp8_trace(trace, "fused"), h100, "single", 1, precision="fp8")["time"]
    eff = h100.efficiencies()
    saved = 12 * MM[1] / (eff.compute * 1e12) * (1 / 989 - 1 / 1979)   # the matmuls at twice the peak
    cast = 12 * elements * 5 / (h100.bandwidth_tb_s * 1e12 * eff.bandwidth)   # fused: 2 x 2 bytes read + 1 written
    assert fused["seconds"] == pytest.approx(bf16["seconds"] - saved + cast, rel=1e-6)
    assert fused["seconds"] < bf16["seconds"] < fp8["seconds"]   # eager casts cost more than the matmuls save
    no_fp8 = estimate_fit(dict(trace, precision="fp8"), a100, "single", 1)   # a trace of an fp8 spec
    assert no_fp8["seconds_per_update"] is None and "no fp8 peak" in no_fp8["time"]["reason"]
    assert any(n["name"] == "FP8 casts (torchao float8)" for n in no_fp8["notes"])
    old = synthetic_trace()   # cached before FP8 was counted: no figure, and the fix
    assert fp8_trace(old, "eager") is None and "--no-trace-cache" in why_none(old)


def test_select_shows_an_fp8_path_on_hopper_and_none_on_the_a100():
    cat = load_catalog()
    spec = load_spec(EXAMPLES / "llama-7b-estimate" / "pilot.yaml", check_files=False)   # bf16, as the trace
    trace = fp8_synthetic()
    config = ("single", 1, 1.0, 1)
    h100 = faster_paths(spec, _Traces(), trace, cat["H100-80GB"], config, None)
    fp8 = next(p for p in h100 if p["path"] == "fp8")
    assert fp8["source"] == "predicted" and fp8["faster"] and fp8["factor"] < 1 < fp8["eager_factor"]
    fa3 = next(p for p in h100 if p["path"] == "flash_attention_3")
    assert "not modelled" in fa3["note"] and fa3["factor"] is None
    assert path_cell({"faster_paths": h100}) == f"fp8 x{fp8['factor']:.2f} predicted"
    a100 = faster_paths(spec, _Traces(), trace, cat["A100-80GB"], config, None)
    assert a100 == [] and path_cell({"faster_paths": a100}) == "—"
    mi300x = faster_paths(spec, _Traces(), trace, cat["MI300X-192GB"], config, None)
    assert [p["path"] for p in mi300x] == ["fp8"]   # FP8 on MI300X; FlashAttention-3 is Hopper's
    fp32 = load_spec(EXAMPLES / "llama-7b-estimate" / "pilot.yaml", ["train.precision=fp32"], check_files=False)
    said = faster_paths(fp32, _Traces(), trace, cat["H100-80GB"], config, None)[0]
    assert said["factor"] is None and "train.precision: bf16" in said["note"]


def test_the_trace_marks_the_matmuls_of_the_linears_fp8_would_convert():
    from pilotrun.estimate.trace import trace_job
    from pilotrun.models.quiet import QuietTransformers

    spec = load_spec(TINY, [*SMALL, "train.precision=bf16"], check_files=False)
    with QuietTransformers():
        trace = trace_job(spec, target="cuda").to_dict()
    assert trace["fp8"] == {"modelled": True, "linears": 14, "skipped": {
        "the output head (kept in high precision, as torchtitan and torchao do)": 1}}
    marked = trace["stages"]["steady_step"]["fp8_ops"]
    assert sum(r[4] for r in marked) == 14 * 3   # forward, input gradient, weight gradient of each
    assert all(r[0] == "bf16" and r[1] > 0 for r in marked)
    assert fp8_ops(trace["stages"]["steady_step"]["ops"], marked, "fused")   # a subset of the traced ops


def test_the_loop_converts_its_linears_and_one_fp8_update_is_finite_on_this_cpu(monkeypatch):
    from pilotrun.drivers import build_driver, join_job, load_inputs
    from pilotrun.drivers.build import check_job

    require("torchao.float8", "torchao")   # the dev extra installs it; pilotrun[fp8] for users
    spec = load_spec(TINY, [*SMALL, "train.precision=fp8", "train.fp8_recipe=rowwise"])
    assert fp8_matmul_problem(torch.device("cpu")) is None   # torch._scaled_mm runs on the CPU
    process = join_job(spec)
    check_job(spec, process.device)
    driver = build_driver(spec, load_inputs(spec), process)
    try:
        assert len(driver.fp8.converted) == 14 and list(driver.fp8.skipped) == ["lm_head"]
        assert type(driver.plain_model.model.layers[0].mlp.down_proj).__name__ == "Float8Linear"
        assert "i:dyn_axs_e4m3" in repr(driver.plain_model.model.layers[0].mlp.down_proj)   # rowwise: per-row scales
        rec = driver.update()
        assert torch.isfinite(torch.tensor(rec.loss)) and rec.grad_norm and rec.grad_norm > 0
    finally:
        driver.close()
    # The checks that compare with high precision (the export's reload, accum_equivalence's float64 copy) see the
    # same Parameters without float8's rounding.
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    x = torch.randn(4, 32)
    want = plain(x)
    assert len(convert_linears(plain, "tensorwise").converted) == 2 and not torch.equal(plain(x), want)
    with linears_in_high_precision(plain) as n:
        assert n == 2 and torch.equal(plain(x), want)
    assert not torch.equal(plain(x), want)   # float8 again outside
    high = high_precision_linears(plain)
    assert [type(m).__name__ for m in high] == ["Linear", "ReLU", "Linear"] and torch.equal(high(x), want)
    # An accelerator without float8 matmuls (an A100: torch._scaled_mm refuses it) is exit 2 naming the field.
    monkeypatch.setattr("pilotrun.train.fp8.fp8_matmul_problem", lambda device: "torch._scaled_mm does not run")
    with pytest.raises(SpecError) as err:
        check_job(spec, process.device)
    assert err.value.problems[0][0] == "train.precision" and "precision: bf16" in err.value.problems[0][1]


def test_the_fp8_variant_reads_against_bf16_and_never_passes_having_converted_nothing():
    from pilotrun.variants.run import Arm, _fp8_said

    fp32 = load_spec(TINY, ["pilot.variants.run=[fp8]"], check_files=False)
    planned = plan_variants(fp32)
    assert [(v.name, v.against) for v in planned.run] == [("bf16", None), ("fp8", "bf16")]
    bf16 = load_spec(TINY, ["pilot.variants.run=[fp8]", "train.precision=bf16"], check_files=False)
    assert [(v.name, v.against) for v in plan_variants(bf16).run] == [("fp8", None)]
    assert "fp8" not in [v.name for v in plan_variants(load_spec(TINY, check_files=False)).run]   # named only
    odd = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.Linear(20, 16))
    chosen, skipped = choose_linears(odd)
    assert chosen == [] and all("multiples of 16" in w for w in skipped.values())
    record = Fp8Record("tensorwise", chosen, skipped)
    assert record.words().startswith("nothing converted to fp8")
    arm = Arm("fp8", fp32, variant=planned.run[1], fp8=record)
    verdict, reason = _fp8_said(arm, Arm("bf16", fp32, variant=planned.run[0]), Verdict.PASS,
                                "fp8: val loss 5.1 vs 5.1", "cpu")
    assert verdict == Verdict.SKIP and "nothing converted" in reason and "against bf16, not the control" in reason


def test_fp8_recipe_leaves_every_other_specs_hash_as_it_was():
    plain = load_spec(TINY, check_files=False)
    assert load_spec(TINY, ["train.fp8_recipe=rowwise"], check_files=False).config_hash() == plain.config_hash()
    assert "fp8_recipe" not in plain.canonical()["train"]
    fp8 = load_spec(TINY, ["train.precision=fp8", "train.fp8_recipe=rowwise"], check_files=False)
    assert fp8.canonical()["train"]["fp8_recipe"] == "rowwise"
    with pytest.raises(SpecError, match="fp8_recipe"):
        load_spec(TINY, ["train.fp8_recipe=blockwise"], check_files=False)
