"""Estimate vs measured, and how fast the estimator is.

    .venv/bin/python bench/estimate_accuracy.py [--adapters-only]

Accuracy: for four different models (an MLP, a Llama-architecture LM, the real
MiniLM classifier, a convolutional net) the fake-tensor trace's peak (CPU target:
no foreach, no rounding) against the pilot's measured peak live tensor bytes for the
same spec on this CPU, for first_step, steady_step and eval. Goal: within ±5%.
Then the jobs of issue 14 on the demo's Llama: LoRA, QLoRA (4-bit nf4 base, bitsandbytes' CPU path),
an 8-bit base, bf16-true, and each new optimizer (8-bit AdamW, paged 8-bit AdamW, Adafactor, fused
AdamW, SGD with momentum). A stage the pilot could not measure here is a row "not measured" with the
gate's reason (paged optimizer state pages only on CUDA). On CPU the tracker sees what a bitsandbytes
kernel returns, not the temporaries inside it: the estimate counts the dequantised weight of the layer
in flight, which a GPU's allocator would see, so it can only be checked on a GPU (``make gpu-check``).
Speed: a Llama-7B-shaped config (length 4096, micro batch 1, bf16) traced once and
fitted on every catalog accelerator × three strategies. Goal: under 60 s on 2 cores.
"""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from _common import machine, write_results  # noqa: E402

from pilotrun.config import load_spec  # noqa: E402
from pilotrun.estimate.catalog import load_catalog  # noqa: E402
from pilotrun.estimate.model import estimate_fit  # noqa: E402
from pilotrun.estimate.worker import trace_in_subprocess  # noqa: E402
from pilotrun.pilot import PilotOptions, run_pilot  # noqa: E402

MODELS = {
    "MLP (6 x 1024, factory)": REPO / "bench" / "specs" / "mlp" / "pilot.yaml",
    "Llama LM (tiny-sft demo)": REPO / "examples" / "tiny-sft" / "pilot.yaml",
    "MiniLM classifier (real weights)": REPO / "examples" / "minilm-classification" / "pilot.yaml",
    "conv net (factory)": REPO / "bench" / "specs" / "convnet" / "pilot.yaml",
}
STAGES = ("first_step", "steady_step", "eval")
TINY = REPO / "examples" / "tiny-sft" / "pilot.yaml"
LORA = "model.adapter={r: 8, alpha: 16, target_modules: all-linear}"
# Issue 14's jobs: (spec, --set overrides) on the demo's Llama.
ADAPTER_JOBS = {
    "LoRA r=8, fp32, AdamW": (TINY, [LORA]),
    "LoRA, bf16-true, fused AdamW": (TINY, [LORA, "train.precision=bf16-true", "train.optimizer.fused=true"]),
    "QLoRA nf4 + double quant, bf16, AdamW8bit": (TINY, [LORA, "model.quantization={bits: 4}",
                                                        "train.precision=bf16", "train.optimizer.name=adamw8bit"]),
    "LoRA on an 8-bit base, fp32, Adafactor": (TINY, [LORA, "model.quantization={bits: 8}",
                                                     "train.optimizer.name=adafactor"]),
    "full, bf16-true, AdamW": (TINY, ["train.precision=bf16-true"]),
    "full, fp32, SGD momentum 0.9": (TINY, ["train.optimizer={name: sgd, lr: 0.05, momentum: 0.9}"]),
    "full, fp32, AdamW8bit": (TINY, ["train.optimizer.name=adamw8bit"]),
    "LoRA, fp32, paged AdamW8bit": (TINY, [LORA, "train.optimizer.name=paged_adamw8bit"]),
}


def measured(spec_path: Path, overrides: list[str] | None = None) -> dict[str, int | str]:
    """Per stage the pilot's measured peak, or the reason it was not measured (a skip row)."""
    with tempfile.TemporaryDirectory() as tmp:
        spec = load_spec(spec_path, overrides)
        result = run_pilot(spec, PilotOptions(out_dir=Path(tmp) / "o", ledger_path=Path(tmp) / "l.sqlite",
                                              gates=["first_step", "steady_step", "eval"]))
        out: dict[str, int | str] = {}
        # A stage skipped for want of an earlier gate carries that gate's reason (e.g. load: "not measured:
        # paged optimizer state needs cuda").
        cause = next((f"{r['gate']}: {r['reason']}" for r in result.rows if r["verdict"] in ("skip", "fail")
                      and not r["reason"].startswith("skipped: needs")), "")
        for r in result.rows:
            if r["gate"] in STAGES:
                peak = (r.get("memory") or {}).get("peak_allocated_bytes")
                out[r["gate"]] = peak if peak else f"not measured: {r['verdict']}: {cause or r['reason']}"
        return out


def compare(name: str, spec_path: Path, overrides: list[str] | None = None) -> list[dict]:
    real = measured(spec_path, overrides)
    trace = trace_in_subprocess(load_spec(spec_path, overrides, check_files=False), target="cpu")
    rows = []
    for stage in STAGES:
        est = trace["stages"][stage]["peak_bytes"]
        got = real.get(stage, "not measured: the gate did not run")
        if isinstance(got, str):
            rows.append({"model": name, "stage": stage, "estimated_bytes": est, "measured_bytes": None,
                         "ratio": None, "within_5pct": None, "not_measured": got, "overrides": overrides or []})
            print(f"{name:<44} {stage:<12} estimated {est / 2**20:9.2f} MiB  {got}")
            continue
        ratio = est / got
        rows.append({"model": name, "stage": stage, "estimated_bytes": est, "measured_bytes": got,
                     "ratio": ratio, "within_5pct": abs(ratio - 1) <= 0.05, "overrides": overrides or []})
        print(f"{name:<44} {stage:<12} estimated {est / 2**20:9.2f} MiB  measured {got / 2**20:9.2f} MiB"
              f"  ratio {ratio:.3f}")
    return rows


def main() -> int:
    only_adapters = "--adapters-only" in sys.argv
    rows = []
    for name, path in ({} if only_adapters else MODELS).items():
        rows += compare(name, path)
    adapter_rows = []
    for name, (path, overrides) in ADAPTER_JOBS.items():
        adapter_rows += compare(name, path, overrides)
    if only_adapters:
        write_results("estimate_accuracy_adapters", {"machine": machine(), "goal": "within ±5% per stage",
                                                     "adapters": adapter_rows})
        return 0
    t0 = time.perf_counter()
    spec = load_spec(REPO / "examples" / "llama-7b-estimate" / "pilot.yaml")
    trace = trace_in_subprocess(spec)
    catalog = load_catalog()
    fits = [estimate_fit(trace, acc, s, n)
            for acc in catalog.values() for s, n in (("single", 1), ("ddp", 4), ("fsdp", 4))]
    seconds = time.perf_counter() - t0
    print(f"Llama-7B-shaped (4096, micro batch 1, bf16): {len(fits)} fits ({len(catalog)} accelerators x 3 strategies) "
          f"in {seconds:.1f} s, of which the trace {trace['seconds']:.1f} s")
    speed = {"seconds": seconds, "fits": len(fits), "trace_seconds": trace["seconds"]}
    write_results("estimate_accuracy", {"machine": machine(), "goal": "within ±5%; 7B in < 60 s",
                                        "accuracy": rows, "adapters": adapter_rows, "speed_7b": speed})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
