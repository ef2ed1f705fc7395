"""Estimate vs measured, and how fast the estimator is.

    .venv/bin/python bench/estimate_accuracy.py

Accuracy: for four different models (an MLP, a Llama-architecture LM, the real
MiniLM classifier, a convolutional net) the fake-tensor trace's peak (CPU target:
no foreach, no rounding) against the pilot's measured peak live tensor bytes for the
same spec on this CPU, for first_step, steady_step and eval. Goal: within ±5%.
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


def measured(spec_path: Path) -> dict[str, int]:
    with tempfile.TemporaryDirectory() as tmp:
        spec = load_spec(spec_path)
        result = run_pilot(spec, PilotOptions(out_dir=Path(tmp) / "o", ledger_path=Path(tmp) / "l.sqlite",
                                              gates=["first_step", "steady_step", "eval"]))
        return {r["gate"]: r["memory"]["peak_allocated_bytes"] for r in result.rows if r["gate"] in STAGES}


def main() -> int:
    rows = []
    for name, path in MODELS.items():
        real = measured(path)
        trace = trace_in_subprocess(load_spec(path), target="cpu")
        for stage in STAGES:
            est = trace["stages"][stage]["peak_bytes"]
            ratio = est / real[stage]
            rows.append({"model": name, "stage": stage, "estimated_bytes": est, "measured_bytes": real[stage],
                         "ratio": ratio, "within_5pct": abs(ratio - 1) <= 0.05})
            print(f"{name:<34} {stage:<12} estimated {est / 2**20:9.2f} MiB  measured {real[stage] / 2**20:9.2f} MiB"
                  f"  ratio {ratio:.3f}")
    t0 = time.perf_counter()
    spec = load_spec(REPO / "examples" / "llama-7b-estimate" / "pilot.yaml")
    trace = trace_in_subprocess(spec)
    catalog = load_catalog()
    fits = [estimate_fit(trace, acc, s, n)
            for acc in catalog.values() for s, n in (("single", 1), ("ddp", 4), ("fsdp", 4))]
    seconds = time.perf_counter() - t0
    print(f"Llama-7B-shaped (4096, micro batch 1, bf16): {len(fits)} fits ({len(catalog)} accelerators x 3 strategies) "
          f"in {seconds:.1f} s, of which the trace {trace['seconds']:.1f} s")
    write_results("estimate_accuracy", {"machine": machine(), "goal": "within ±5%; 7B in < 60 s",
                                        "accuracy": rows, "speed_7b": {"seconds": seconds, "fits": len(fits),
                                                                       "trace_seconds": trace["seconds"]}})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
