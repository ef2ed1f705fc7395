"""pilotrun's estimate against peak memory other projects measured on real GPUs and published.

    .venv/bin/python bench/published_memory.py

Each row is compared with the counter its source recorded (``torch.cuda.max_memory_allocated`` or
``max_memory_reserved``), against the estimate's figure for that counter (the row's ``peak_allocated_bytes`` or
``peak_reserved_bytes``: corrections included, as a user reads them).

torchtitan (benchmarks/llama3_h100_202412_torchtitan.md, commit 31a17bf): Llama 3.1 8B with FSDP2 on 8 and 128
H100s, local batch 2 x 8192 tokens, per-op selective checkpointing, its "Memory(GiB)" the max reserved. The H100s
are Grand Teton's 96 GB HBM2e at 500 W, an entry of ``bench/published/catalog-h100-hbm2e.yaml``.

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

FMS = ("https://github.com/foundation-model-stack/fms-acceleration/blob/04702cc5b9f0e198d545b88a7c6fd9ade8c50bb8/"
       "scripts/benchmarks/refs/a100_80gb.csv")
TITAN = ("https://github.com/pytorch/torchtitan/blob/31a17bfdb70bab6f62a13d21816a5339b911d6e3/benchmarks/"
         "llama3_h100_202412_torchtitan.md")
SPECS = REPO / "bench" / "published"
GiB = 2**30


def _fms(job: str, spec: str, batch: int, row: int, peak: int, state: int) -> dict:
    """An fms-acceleration CSV row: torch.cuda.max_memory_allocated over init + train on one A100-80GB, and what stays
    allocated after training."""
    return {"job": job, "spec": spec, "set": [f"train.micro_batch_size={batch}"], "accelerator": "A100-80GB",
            "strategy": "single", "gpus": 1, "counter": "allocated", "published_bytes": peak,
            "published_state_bytes": state, "source": f"{FMS} row {row}"}


def _titan(gpus: int, gib: float, table: str) -> dict:
    """A torchtitan benchmark row: Llama 3.1 8B, FSDP2 over ``gpus`` H100s (96 GB HBM2e at 500 W, the catalog entry
    beside the specs), local batch 2 of 8192 tokens, per-op selective checkpointing (torchtitan's "op": one mm in 2
    kept), no torch.compile; "Memory(GiB)" is torch.cuda's max reserved (torchtitan's metrics log
    max_reserved_gib)."""
    return {"job": f"Llama-3.1-8B, 8192 x 2, op SAC, FSDP2 {gpus}x H100", "spec": "llama3-8b.yaml",
            # The update's examples over the GPUs (times.yaml's convention): each GPU runs one micro batch of 2.
            "set": ["train.micro_batch_size=2", f"train.grad_accum_steps={gpus}",
                    "train.activation_checkpointing=selective-2"],
            "accelerator": "H100-96GB-HBM2e", "catalog": "catalog-h100-hbm2e.yaml", "strategy": "fsdp", "gpus": gpus,
            "counter": "reserved", "published_bytes": int(gib * GiB), "source": f"{TITAN} {table}, row FSDP"}


RUNS = [
    _fms("Mistral-7B LoRA, fp16 weights", "mistral-7b-lora.yaml", 4, 12, 26108963328, 15119590912),
    _fms("Mistral-7B LoRA, fp16 weights", "mistral-7b-lora.yaml", 8, 14, 37098695168, 15119984128),
    _fms("Mistral-7B QLoRA nf4, fp16 AMP", "mistral-7b-qlora.yaml", 4, 24, 22825932800, 5368221184),
    _fms("Mistral-7B QLoRA nf4, fp16 AMP", "mistral-7b-qlora.yaml", 8, 26, 40278956032, 5368614400),
    _fms("Mistral-7B full, bf16 weights", "mistral-7b-full.yaml", 4, 0, 72971724288, 44004763136),
    _fms("Mistral-7B full, bf16 weights", "mistral-7b-full.yaml", 8, 2, 72972117504, 44005156352),
    _titan(8, 82.4, "Table 1"),
    _titan(128, 67.0, "Table 3"),
]


def estimate(run: dict) -> dict:
    cmd = [sys.executable, "-m", "pilotrun", "estimate", str(SPECS / run["spec"]), "--accelerator", run["accelerator"],
           "--strategy", run["strategy"], "--gpus", str(run["gpus"]), "--no-advice", "--json"]
    if run.get("catalog"):
        cmd += ["--catalog", str(SPECS / run["catalog"])]
    for item in run["set"]:
        cmd += ["--set", item]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, check=False)
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stderr}")
    return json.loads(res.stdout)


def main() -> None:
    rows = []
    print(f"{'job':44} {'set':>28} {'counter':>9} {'published':>10} {'estimate':>9} {'ratio':>6}")
    for run in RUNS:
        est = estimate(run)
        fit = est["fits"][0]
        # The row's own counter: torch.cuda.max_memory_allocated or max_memory_reserved, as the source recorded it.
        mine = fit["peak_allocated_bytes"] if run["counter"] == "allocated" else fit["peak_reserved_bytes"]
        row = {**run, "spec": f"bench/published/{run['spec']}", "estimated_bytes": mine,
               "ratio": round(mine / run["published_bytes"], 4), "limiting_stage": fit.get("limiting_stage")}
        if "published_state_bytes" in run:
            # What stays allocated after training: parameters and optimizer state (the Trainer frees gradients with
            # set_to_none; counting them read 1.32x on the full fine-tune, whose gradients are 14.5 GB).
            m = est["model"]
            state = m["parameter_bytes"] + m["optimizer_state_bytes"]
            row.update(estimated_state_bytes=state, state_ratio=round(state / run["published_state_bytes"], 4))
        rows.append(row)
        print(f"{run['job']:44} {' '.join(s.split('=')[-1] for s in run['set']):>28} {run['counter']:>9} "
              f"{run['published_bytes'] / GiB:>6.2f} GiB {mine / GiB:>5.2f} GiB {row['ratio']:>6.3f}")
    within = sum(abs(r["ratio"] - 1) <= 0.10 for r in rows)
    print(f"\n{within} of {len(rows)} within ±10% of the published counter")
    write_results("published_memory", {"sources": [FMS, TITAN], "assumed": "fms rows: every sequence 4096 tokens",
                                       "within_10_percent": within, "machine": machine(), "rows": rows})


if __name__ == "__main__":
    main()
