"""Per-rank estimate vs measured for DDP and FSDP2 on two CPU processes (gloo).

    .venv/bin/python bench/distributed_estimate.py
    .venv/bin/python bench/distributed_estimate.py --tag lora --set model.adapter.type=lora ...   # a variant

The fake-tensor trace of one rank's work (CPU target) goes through the same per-rank model
`pilotrun estimate` uses for GPUs, with the GPU-only corrections set to zero (no allocator
margin, workspace, context or NCCL buffers on CPU); `pilotrun launch --nproc-per-node 2`
measures each rank's peak live tensor bytes. Prints the ratio per stage and rank.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from _common import machine, write_results  # noqa: E402

from pilotrun.config import load_spec  # noqa: E402
from pilotrun.estimate.catalog import load_catalog  # noqa: E402
from pilotrun.estimate.model import stage_memory  # noqa: E402
from pilotrun.estimate.worker import trace_in_subprocess  # noqa: E402

SPEC = REPO / "examples" / "tiny-sft" / "pilot.yaml"
STAGES = ("first_step", "steady_step", "eval")


def cpu_target():
    """The catalog's shape with every GPU-only overhead at zero: what a CPU rank holds."""
    base = next(iter(load_catalog().values()))
    return dataclasses.replace(base, name="cpu", blas_workspace_bytes=0, context_bytes=0, nccl_buffer_bytes=0,
                               defaults={**base.defaults, "reserved_margin": 0.0})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a spec override, repeatable")
    ap.add_argument("--tag", default="", help="results file distributed_estimate-TAG-<device>-<date>.json")
    args = ap.parse_args()
    acc = cpu_target()
    trace = trace_in_subprocess(load_spec(SPEC, args.set), target="cpu")
    sets = [x for item in args.set for x in ("--set", item)]
    rows = []
    for strategy in ("ddp", "fsdp"):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "run"
            subprocess.run([sys.executable, "-m", "pilotrun", "launch", "--nproc-per-node", "2", str(SPEC),
                            *sets, "--set", f"distributed.strategy={strategy}",
                            "--gates", "first_step,steady_step,eval",
                            "--out", str(out), "--ledger", str(Path(tmp) / "l.sqlite")],
                           check=True, capture_output=True)
            report = json.loads((out / "report.json").read_text())
        for stage in STAGES:
            est = stage_memory(trace, stage, acc, strategy, 2)["peak_allocated_bytes"]
            for g in report["gates"]:
                if g["gate"] != stage:
                    continue
                real = g["memory"]["peak_allocated_bytes"]
                rows.append({"strategy": strategy, "stage": stage, "rank": g["rank"], "estimated_bytes": est,
                             "measured_bytes": real, "ratio": est / real})
                print(f"{strategy:<5} {stage:<12} rank {g['rank']}  estimated {est / 2**20:7.2f} MiB  "
                      f"measured {real / 2**20:7.2f} MiB  ratio {est / real:.3f}")
    write_results("distributed_estimate" + (f"-{args.tag}" if args.tag else ""),
                  {"machine": machine(), "spec": str(SPEC.relative_to(REPO)), "set": args.set, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
