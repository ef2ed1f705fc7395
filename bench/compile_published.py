"""What torch.compile does to an 8B job's memory and time: torchtitan's published runs beside pilotrun's estimate.

    .venv/bin/python bench/compile_published.py            # traces the 8B shape (minutes on 2 cores): `make bench`
    .venv/bin/python bench/compile_published.py --layers 4 # the same shape with 4 layers: the per-layer effect

torchtitan (benchmarks/llama3_h100_202412_torchtitan.md, commit 31a17bf), Llama 3.1 8B, FSDP2, local batch 2 x 8192
tokens, selective (per-op) activation checkpointing, H100 96 GB HBM2e at 500 W: Table 1 (8 GPUs) and Table 3 (128
GPUs), rows "FSDP" and "FSDP + torch.compile" (torchtitan compiles each transformer block: ``compile: blocks``).
"Memory(GiB)" is torch.cuda's max reserved. Compiled: 5.4 and 5.0 GiB less, 1.157x and 1.162x the tokens per second.

pilotrun's estimate of the same job (bench/published/llama3-8b.yaml with the rows' sets) with ``train.compile``
off and blocks. The estimate models what the compiled graph *saves for backward* (AOT autograd's min-cut
partitioner) and fused element-wise bytes; under activation checkpointing it models no memory change (its row says
"not modelled"), so the published runs' 5 GiB -- which under selective checkpointing come from fewer transient
buffers in the compiled kernels, not from saved activations -- is not predicted: the row prints the gap. The same
job without checkpointing (no published row) shows what the model does predict.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "bench")]

from _common import machine, write_results  # noqa: E402

TITAN = ("https://github.com/pytorch/torchtitan/blob/31a17bfdb70bab6f62a13d21816a5339b911d6e3/benchmarks/"
         "llama3_h100_202412_torchtitan.md")
SPEC = REPO / "bench" / "published" / "llama3-8b.yaml"
CATALOG = REPO / "bench" / "published" / "catalog-h100-hbm2e.yaml"
GiB = 2**30

# (table, GPUs): eager and compiled tokens per second per GPU and max reserved GiB, as published.
PUBLISHED = [
    {"table": "Table 1", "gpus": 8, "eager_tps": 5762, "compiled_tps": 6667, "eager_gib": 82.4, "compiled_gib": 77.0,
     "source": f"{TITAN} Table 1, rows FSDP and FSDP + torch.compile"},
    {"table": "Table 3", "gpus": 128, "eager_tps": 5605, "compiled_tps": 6514, "eager_gib": 67.0, "compiled_gib": 62.0,
     "source": f"{TITAN} Table 3, rows FSDP and FSDP + torch.compile"},
]


def estimate(gpus: int, compile_scope: str, ac: str, layers: int | None) -> dict:
    """The estimate's first row (FSDP over ``gpus`` of the catalog's H100 HBM2e) for the published job."""
    sets = ["train.micro_batch_size=2", f"train.grad_accum_steps={gpus}", f"train.activation_checkpointing={ac}",
            f"train.compile={compile_scope}"] + ([f"model.config.num_hidden_layers={layers}"] if layers else [])
    cmd = [sys.executable, "-m", "pilotrun", "estimate", str(SPEC), "--accelerator", "H100-96GB-HBM2e", "--catalog",
           str(CATALOG), "--strategy", "fsdp", "--gpus", str(gpus), "--no-advice", "--json"]
    for item in sets:
        cmd += ["--set", item]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, check=False)
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stderr}")
    fit = json.loads(res.stdout)["fits"][0]
    row = next((n for n in fit["corrections"] if n["name"] == "torch.compile"), None)
    return {"reserved_bytes": fit["peak_reserved_bytes"], "seconds_per_update": fit["seconds_per_update"],
            "compile_row": row["reason"] if row else None}


def compare(pub: dict, ac: str, layers: int | None) -> dict:
    eager, compiled = (estimate(pub["gpus"], scope, ac, layers) for scope in ("off", "blocks"))
    speed = (eager["seconds_per_update"] / compiled["seconds_per_update"]
             if eager["seconds_per_update"] and compiled["seconds_per_update"] else None)
    published = ac == "selective-2" and not layers
    return {"table": pub["table"], "gpus": pub["gpus"], "activation_checkpointing": ac, "layers": layers or 32,
            "published": published, "source": pub["source"] if published else None,
            "published_less_gib": round(pub["eager_gib"] - pub["compiled_gib"], 2) if published else None,
            "published_speedup": round(pub["compiled_tps"] / pub["eager_tps"], 3) if published else None,
            "estimated_less_gib": round((eager["reserved_bytes"] - compiled["reserved_bytes"]) / GiB, 2),
            "estimated_speedup": round(speed, 3) if speed else None, "compile_row": compiled["compile_row"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, help="trace the shape with this many layers (no published row then)")
    ap.add_argument("--tables", default="Table 1", help="comma-separated published tables to run (Table 1, Table 3)")
    args = ap.parse_args()
    wanted = {t.strip() for t in args.tables.split(",")}
    rows = [compare(pub, ac, args.layers) for pub in PUBLISHED if pub["table"] in wanted
            for ac in ("selective-2", "off")]
    print(f"{'table':8} {'gpus':>4} {'AC':>11} {'layers':>6} {'published':>18} {'estimate':>18}")
    for r in rows:
        pub = (f"-{r['published_less_gib']} GiB x{r['published_speedup']}" if r["published"] else "no published row")
        print(f"{r['table']:8} {r['gpus']:>4} {r['activation_checkpointing']:>11} {r['layers']:>6} {pub:>18} "
              f"{'-' + str(r['estimated_less_gib']) + ' GiB x' + str(r['estimated_speedup']):>18}")
        print(f"    {r['compile_row']}")
    write_results("compile_published" + (f"-layers{args.layers}" if args.layers else ""),
                  {"sources": [TITAN], "machine": machine(), "rows": rows})


if __name__ == "__main__":
    main()
