"""pilotrun's estimate against peak memory other projects measured on real GPUs and published.

    .venv/bin/python bench/published_memory.py

Source (the only one so far whose every run records the job in full and both of torch's counters):
foundation-model-stack/fms-acceleration, scripts/benchmarks/refs/a100_80gb.csv (commit 04702cc), written by
its benchmark.py from the HF Trainer's memory metrics on one A100-80GB: ``peak_torch_mem_alloc_in_bytes`` is
``torch.cuda.max_memory_allocated`` over init + train, ``torch_mem_alloc_in_bytes`` what stays allocated.
Mistral-7B-v0.1, LoRA r=16 on q/k/v/o (and a full fine-tune), gradient checkpointing, one GPU, per-device batch 4
and 8;
the specs in bench/published/ say how each run is mapped onto pilotrun's keys.

What the CSV does not record, and is assumed here: every sequence is 4096 tokens long (fms-hf-tuning's default
maximum length). The assumption is checked by the CSV itself: going from batch 4 to 8 adds 4 sequences' worth of
activations, whose measured size (10.99 GB for LoRA) fits 4 × 4096 tokens of this model, not the few hundred
of an unpadded Alpaca sample. The estimate is a prediction, not a fit: nothing in pilotrun was tuned to it.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "bench")]

from _common import machine, write_results  # noqa: E402

SOURCE = ("https://github.com/foundation-model-stack/fms-acceleration/blob/04702cc5b9f0e198d545b88a7c6fd9ade8c50bb8/"
          "scripts/benchmarks/refs/a100_80gb.csv")
SPECS = REPO / "bench" / "published"
# (job, spec, micro batch, CSV row index, peak_torch_mem_alloc_in_bytes, torch_mem_alloc_in_bytes)
RUNS = [
    ("Mistral-7B LoRA, fp16 weights", "mistral-7b-lora.yaml", 4, 12, 26108963328, 15119590912),
    ("Mistral-7B LoRA, fp16 weights", "mistral-7b-lora.yaml", 8, 14, 37098695168, 15119984128),
    ("Mistral-7B QLoRA nf4, fp16 AMP", "mistral-7b-qlora.yaml", 4, 24, 22825932800, 5368221184),
    ("Mistral-7B QLoRA nf4, fp16 AMP", "mistral-7b-qlora.yaml", 8, 26, 40278956032, 5368614400),
    ("Mistral-7B full, bf16 weights", "mistral-7b-full.yaml", 4, 0, 72971724288, 44004763136),
    ("Mistral-7B full, bf16 weights", "mistral-7b-full.yaml", 8, 2, 72972117504, 44005156352),
]


def estimate(spec: Path, batch: int) -> dict:
    cmd = [sys.executable, "-m", "pilotrun", "estimate", str(spec), "--accelerator", "A100-80GB",
           "--strategy", "single", "--no-advice", "--json", "--set", f"train.micro_batch_size={batch}"]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, check=False)
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stderr}")
    return json.loads(res.stdout)


def main() -> None:
    rows = []
    print(f"{'job':32} {'batch':>5} {'published peak':>15} {'estimate':>9} {'ratio':>6}   "
          f"{'published state':>15} {'estimate':>9} {'ratio':>6}")
    for job, spec, batch, row, peak, state in RUNS:
        est = estimate(SPECS / spec, batch)
        m = est["model"]
        est_peak = max(s["peak_bytes"] for s in est["stages"].values() if isinstance(s, dict) and "peak_bytes" in s)
        # What stays allocated after training: parameters and optimizer state (the Trainer frees gradients with
        # set_to_none; counting them read 1.32x on the full fine-tune, whose gradients are 14.5 GB).
        est_state = m["parameter_bytes"] + m["optimizer_state_bytes"]
        rows.append({"job": job, "spec": f"bench/published/{spec}", "micro_batch_size": batch, "csv_row": row,
                     "published_peak_bytes": peak, "estimated_peak_bytes": est_peak,
                     "peak_ratio": round(est_peak / peak, 4), "published_allocated_bytes": state,
                     "estimated_state_bytes": est_state, "state_ratio": round(est_state / state, 4)})
        print(f"{job:32} {batch:>5} {peak / 1e9:>12.2f} GB {est_peak / 1e9:>6.2f} GB {est_peak / peak:>6.3f}   "
              f"{state / 1e9:>12.2f} GB {est_state / 1e9:>6.2f} GB {est_state / state:>6.3f}")
    write_results("published_memory", {"source": SOURCE, "assumed": "every sequence 4096 tokens",
                                       "machine": machine(), "rows": rows})


if __name__ == "__main__":
    main()
