"""bench/gpu_check.py (`make gpu-check`) kept from rotting on a CPU-only CI.

The dry mode replaces only the device query: the test runs the real command, which pilots the demo on
the CPU, estimates it for the catalog's H200, compares, fits and writes both files; the comparison and
the fit are also checked on recorded GPU-like rows, where every counter exists.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
import gpu_check  # noqa: E402

GIB = 2**30


def test_the_dry_device_function_makes_no_cuda_call(monkeypatch):
    import torch

    def no(*_a, **_k):
        raise AssertionError("a CUDA call in the dry mode")

    for name in ("mem_get_info", "get_device_name", "is_available"):
        monkeypatch.setattr(torch.cuda, name, no)
    facts = gpu_check.device_facts(True)
    assert facts["dry"] and facts["device"] == "cpu" and facts["catalog"] == gpu_check.DRY_ACCELERATOR
    assert gpu_check.accelerator(facts).name == "H200-141GB"


def test_every_variant_is_planned_and_a_missing_feature_is_not_measured_with_its_reason(monkeypatch, tmp_path):
    facts = {"device": "cuda", "bnb_cuda": False, "bnb_reason": "bitsandbytes loaded CPU library, no CUDA build"}
    monkeypatch.setitem(gpu_check.EXAMPLES, "lora-sft", tmp_path / "absent" / "pilot.yaml")
    items = {i["key"]: i for i in gpu_check.plan(facts)}
    assert set(items) == {f"tiny-sft:{v}" for v in ("fp32", "bf16", "bf16-true", "adamw8bit")} | {
        f"lora-sft:{v}" for v in ("fp32", "bf16", "bf16-true", "qlora", "adamw8bit")} | {
        f"llama-1b:{v}" for v in ("full-bf16-true", "no-checkpointing", "lora", "foreach-adamw", "length-4096")}
    # The rented-size job is planned first (the budget may not reach the last items), at its real size on a GPU.
    assert list(items)[0] == "llama-1b:full-bf16-true" and items["llama-1b:full-bf16-true"]["overrides"] == [
        "train.device=cuda"]
    assert items["llama-1b:foreach-adamw"]["overrides"] == ["train.optimizer.fused=false", "train.device=cuda"]
    dry = {i["key"]: i for i in gpu_check.plan({**facts, "device": "cpu", "dry": True})}
    assert "model.config.num_hidden_layers=2" in dry["llama-1b:lora"]["overrides"]
    assert dry["tiny-sft:bf16"]["overrides"] == ["train.precision=bf16", "train.device=cpu"]
    assert items["tiny-sft:fp32"]["not_measured"] is None and items["tiny-sft:fp32"]["gates"] is None  # every gate
    assert items["tiny-sft:bf16"]["overrides"] == ["train.precision=bf16", "train.device=cuda"]
    assert items["lora-sft:fp32"]["not_measured"] == ("not measured: examples/lora-sft is not on this branch "
                                                      "(branch lora adds it)")
    # With every feature on the branch, only the machine's bitsandbytes build keeps 8-bit AdamW out.
    (tmp_path / "lora").mkdir()
    (tmp_path / "lora" / "pilot.yaml").write_text("name: x\n")
    monkeypatch.setitem(gpu_check.EXAMPLES, "lora-sft", tmp_path / "lora" / "pilot.yaml")
    monkeypatch.setattr(gpu_check.importlib.util, "find_spec", lambda name: object())
    items = {i["key"]: i for i in gpu_check.plan(facts)}
    assert items["lora-sft:bf16-true"]["not_measured"] is None
    assert items["tiny-sft:adamw8bit"]["not_measured"] == ("not measured: needs a CUDA build of bitsandbytes "
                                                           "(bitsandbytes loaded CPU library, no CUDA build)")
    items = {i["key"]: i for i in gpu_check.plan({**facts, "bnb_cuda": True})}
    assert all(i["not_measured"] is None for i in items.values())


def _row(gate, alloc, reserved, used):
    return {"gate": gate, "verdict": "pass", "reason": "",
            "memory": {"peak_allocated_bytes": alloc, "peak_reserved_bytes": reserved, "device_used_bytes": used}}


def test_the_comparison_and_the_fit_on_recorded_gpu_counters():
    acc = gpu_check.load_catalog()["H100-80GB"]
    est = {s: {"peak_allocated_bytes": 2 * GIB, "peak_reserved_bytes": 3 * GIB, "device_used_bytes": 4 * GIB}
           for s in gpu_check.STAGES}
    rows = [_row("first_step", 2 * GIB, int(2.5 * GIB), 4 * GIB), _row("steady_step", 2 * GIB, 3 * GIB, 5 * GIB),
            {"gate": "eval", "verdict": "pass", "reason": "", "memory": {
                "peak_allocated_bytes": GIB, "peak_reserved_bytes": None, "device_used_bytes": None,
                "not_measured": {"peak_reserved_bytes": "rocm-smi unreadable"}}}]
    cmp = {(c["stage"], c["counter"]): c for c in gpu_check.compare(est, rows, used_before=GIB)}
    assert cmp["first_step", "allocated"]["ratio"] == 1.0 and cmp["first_step", "reserved"]["ratio"] == 1.2
    assert cmp["first_step", "used"]["measured_bytes"] == 3 * GIB  # what another process held before is taken off
    assert cmp["eval", "reserved"]["not_measured"] == "not measured: rocm-smi unreadable"
    assert cmp["eval", "used"]["not_measured"] == "not measured: the meter gave no value"
    f = gpu_check.fit([{"rows": rows, "used_before": GIB, "utilisation": 0.3},
                       {"rows": [], "utilisation": 0.5}, {"not_measured": "not measured: x"}], acc)
    assert f["reserved_margin"]["fitted"] == pytest.approx(0.5) and f["reserved_margin"]["n"] == 2  # the largest
    assert f["context_bytes"] == {"fitted": int(0.75 * GIB), "n": 2}  # median of used - before - reserved
    assert f["utilisation"]["fitted"] == pytest.approx(0.4) and f["catalog_now"]["reserved_margin"] == 0.10
    assert gpu_check.fit([], acc)["reserved_margin"].startswith("not measured: ")
    # The table shows every comparison, and what could not be measured or estimated, with its reason.
    payload = {"device": {"name": "NVIDIA H100 80GB HBM3", "dry": False}, "date": "2026-12-01", "accelerator": acc.name,
               "gpu_tests": {"command": "pytest -m gpu", "summary": "4 passed", "returncode": 0}, "fit": f,
               "results": [{"example": "lora-sft", "variant": "qlora", "estimate_error": "the estimate failed: x",
                            "comparison": gpu_check.compare({}, rows, None)},
                           {"example": "tiny-sft", "variant": "bf16-true", "not_measured": "not measured: why"}]}
    md = gpu_check.markdown(payload)
    assert "| lora-sft | qlora | | | | | | the estimate failed: x |" in md
    assert "| lora-sft | qlora | first_step |  | — | — | — | not measured: no first_step estimate |" in md
    assert "| tiny-sft | bf16-true | | | | | | not measured: why |" in md and "Dry run" not in md


@pytest.mark.process
def test_the_dry_mode_runs_the_same_code_and_writes_both_files(tmp_path):
    # One pilot, whichever branch this is: bf16-true on the LoRA example once branch lora is in (the demo in bf16
    # before); the other keys are listed with their reason -- QLoRA and 8-bit AdamW need a CUDA bitsandbytes,
    # which a dry run never has, and before branch lora the LoRA example itself is missing.
    # With branch lora in, the pilot is the rented-size job's LoRA variant (bf16-true), shrunk as a dry run shrinks it.
    lora = gpu_check.missing(gpu_check.Need.LORA_EXAMPLE, {}) is None
    measured = "llama-1b:lora" if lora else "tiny-sft:bf16"
    keys = [measured, "lora-sft:qlora", "tiny-sft:adamw8bit"] + ([] if lora else ["lora-sft:bf16-true"])
    res = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_check.py"), "--dry", "--out", str(tmp_path),
                          "--only", ",".join(keys), "--gpu-tests", "tests/test_gpu.py"],
                         capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stdout + res.stderr
    (js,) = tmp_path.glob("gpu_check-dry-cpu-*.json")
    payload = json.loads(js.read_text())
    assert payload["device"]["dry"] and payload["accelerator"] == "H200-141GB"
    assert payload["gpu_tests"]["returncode"] in (0, 5) and "skipped" in payload["gpu_tests"]["summary"]
    by = {r["key"]: r for r in payload["results"]}
    assert set(by) == set(keys)
    run = by[measured]
    assert run["status"] == "pass" and {r["gate"] for r in run["rows"]} >= {"first_step", "steady_step", "eval"}
    assert "warning" not in run, run.get("warning")  # bf16-true: the load row shows bf16 weights
    allocated = [c for c in run["comparison"] if c["counter"] == "allocated"]
    assert len(allocated) == 3 and all(c["estimated_bytes"] > 0 and c["measured_bytes"] > 0 for c in allocated)
    reserved = [c for c in run["comparison"] if c["counter"] == "reserved"]
    assert all(c["not_measured"].startswith("not measured: cpu has no caching-allocator counter") for c in reserved)
    for key in set(keys) - {measured}:
        assert by[key]["not_measured"].startswith("not measured: ") and "rows" not in by[key]
    assert by["tiny-sft:adamw8bit"]["not_measured"].startswith(
        "not measured: needs a CUDA build of bitsandbytes" if lora else "not measured: bitsandbytes bases")
    assert payload["fit"]["reserved_margin"].startswith("not measured")
    md = js.with_suffix(".md").read_text()
    assert "**Dry run**" in md and f"| {measured.replace(':', ' | ')} | steady_step | allocated |" in md
    # The time model's estimate beside the measured update (an H200's estimate against a CPU: only the plumbing).
    assert run["time"]["measured_seconds"] > 0 and run["time"]["estimated_seconds"] > 0
    assert run["time"]["model"] == "roofline" and f"| {measured.replace(':', ' | ')} | " in md.split("## Time")[1]
