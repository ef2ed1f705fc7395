"""pilotrun's estimate against peak memory other projects measured on real GPUs and published.

    .venv/bin/python bench/published_memory.py
    .venv/bin/python bench/published_memory.py --only QLoRA --tag offload   # the rows whose job contains it

``--only`` runs the rows whose job name contains the text; ``--tag`` names the results file
(``published_memory-TAG-<device>-<date>.json``) so a partial run does not replace the full one of the same day.

Each row is compared with the counter its source recorded (``torch.cuda.max_memory_allocated`` or
``max_memory_reserved``), against the estimate's figure for that counter (the row's ``peak_allocated_bytes`` or
``peak_reserved_bytes``: corrections included, as a user reads them).

torchtitan (benchmarks/llama3_h100_202412_torchtitan.md, commit 31a17bf): Llama 3.1 8B with FSDP2 on 8 and 128
H100s, local batch 2 x 8192 tokens, per-op selective checkpointing, its "Memory(GiB)" the max reserved. The H100s
are Grand Teton's 96 GB HBM2e at 500 W, an entry of ``bench/published/catalog-h100-hbm2e.yaml``.

foundation-model-stack/fms-acceleration, scripts/benchmarks/refs/a100_80gb.csv (commit 04702cc), written by
its benchmark.py from the HF Trainer's memory metrics on A100-80GBs: ``peak_torch_mem_alloc_in_bytes`` is
``torch.cuda.max_memory_allocated`` over init + train, ``torch_mem_alloc_in_bytes`` what stays allocated.
Mistral-7B-v0.1, Llama-2-70B and Mixtral-8x7B; LoRA r=16 on q/k/v/o over fp16 weights or an nf4 base (QLoRA, with
TRL's preparation or the plugin's), and a full fine-tune; gradient checkpointing; one GPU at per-device batch 4 and
8, or two with accelerate's FSDP1 at 2 and 4. The specs in bench/published/ say how each run is mapped onto
pilotrun's keys. Runs the CSV left without a result while ~80 GB was in use are set beside the estimate's fit
(NO_RESULT): the CSV records no error, so they count toward no goal.

huggingface/peft docs/source/accelerate/fsdp.md, "Use PEFT QLoRA and FSDP ...", "Memory usage": Llama-2-70B QLoRA on
2 GPUs with FSDP1's ``fsdp_offload_params: true`` ("19.6 GB" per GPU) and without it ("35.6 GB/ GPU"). The page names
no counter, so those rows are set beside the estimate's allocated, reserved and device-used peaks and counted toward
no goal; bench/published/llama2-70b-qlora-fsdp-offload.yaml says what else the page leaves unsaid.

What the CSV does not record, and is assumed here: every sequence is 4096 tokens long (fms-hf-tuning's default
maximum length). The assumption is checked by the CSV itself: going from batch 4 to 8 adds 4 sequences' worth of
activations, whose measured size (10.99 GB for LoRA) fits 4 × 4096 tokens of this model, not the few hundred
of an unpadded Alpaca sample. The estimate is a prediction, not a fit: nothing in pilotrun was tuned to it.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "bench")]

from _common import machine, write_results  # noqa: E402

FMS = ("https://github.com/foundation-model-stack/fms-acceleration/blob/04702cc5b9f0e198d545b88a7c6fd9ade8c50bb8/"
       "scripts/benchmarks/refs/a100_80gb.csv")
TITAN = ("https://github.com/pytorch/torchtitan/blob/31a17bfdb70bab6f62a13d21816a5339b911d6e3/benchmarks/"
         "llama3_h100_202412_torchtitan.md")
PEFT = "https://github.com/huggingface/peft/blob/e0cfce661a12411bf8587aa168160e44f7ff0034/docs/source/accelerate/fsdp.md"
TORCHAO = "https://github.com/pytorch/ao/blob/9519bebbc397d60274982a74c084f9dff18e61a6/torchao/float8/README.md"
SPECS = REPO / "bench" / "published"
GiB = 2**30


def _fms(job: str, spec: str, batch: int, row: int, peak: int, state: int, gpus: int = 1,
         also: tuple[str, ...] = ()) -> dict:
    """An fms-acceleration CSV row: torch.cuda.max_memory_allocated over init + train on each A100-80GB, and what
    stays allocated after training. Over 2 GPUs the run is accelerate's FSDP1 (scripts/benchmarks/accelerate.yaml:
    FULL_SHARD, BACKWARD_PRE prefetch) with the per-device batch ``batch``; the estimate's fsdp row is FSDP2's."""
    return {"job": job + (f", FSDP1 {gpus}x A100" if gpus > 1 else ""), "spec": spec,
            "set": [f"train.micro_batch_size={batch}", *also], "accelerator": "A100-80GB",
            "strategy": "fsdp" if gpus > 1 else "single", "gpus": gpus, "counter": "allocated",
            "published_bytes": peak, "published_state_bytes": state, "source": f"{FMS} row {row}",
            "published_stack": FMS_STACK}


# What the fms runs held that the estimate, tracing today's transformers, cannot: fms-acceleration's framework plugin
# pinned transformers<4.40 at that commit (plugins/framework/pyproject.toml), and transformers 4.39's Llama, Mistral and
# Mixtral attention layers each keep their rotary embedding's cos and sin for every position up to
# max_position_embeddings as buffers in the default dtype (float16 under torch_dtype float16: LlamaRotaryEmbedding's
# _cos_cached/_sin_cached, MistralRotaryEmbedding's cos_cached/sin_cached). Buffers are neither sharded by FSDP nor
# freed, so every GPU holds them from load to the end; today's models compute cos and sin per forward instead.
FMS_STACK = "transformers 4.39 (fms-acceleration's plugin pinned transformers<4.40): per-layer rotary cos/sin caches"


def rotary_cache_bytes(config: dict) -> int:
    """transformers 4.39's per-attention-layer rotary caches: cos and sin, max_position_embeddings x head_dim, fp16."""
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    return config["num_hidden_layers"] * 2 * config["max_position_embeddings"] * head_dim * 2


# The plugin's own k-bit preparation ("accelerated-peft-bnb"): no fp32 upcast of the base's other weights.
PREP = ("model.quantization.prepare=none",)


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


def _torchao(accelerator: str, precision: str, gib: float) -> dict:
    """A row of torchao's float8 "Training benchmarks" (its README): Llama3-8b with torchtitan on one node of 8 GPUs,
    batch 1 of 8192 tokens, torch.compile, FSDP2, per-op SAC, in bf16 or float8 (tensorwise with float8 all-gather, or
    rowwise). Its "Peak Memory (GB)" is what torchao's parse_torchtitan_logs.py reads from torchtitan's log: the
    largest "memory: X GiB", torchtitan's max reserved. The H100 variant is not named (the built-in H100-80GB, SXM,
    assumed); the MI300X rows ran a newer torch (2.9.0.dev, ROCm 6.4) and torchtitan (2c8b594) than the H100 rows
    (2.7.0a0, torchtitan 0.0.2)."""
    name, sets = {"bf16": ("bf16", ["train.precision=bf16"]),
                  "tensorwise": ("float8 tensorwise", ["train.precision=fp8", "train.fp8_recipe=tensorwise"]),
                  "rowwise": ("float8 rowwise", ["train.precision=fp8", "train.fp8_recipe=rowwise"])}[precision]
    gpu = "H100" if accelerator.startswith("H100") else "MI300X"
    return {"job": f"Llama3-8b, 8192 x 1, op SAC, compile, {name}, 8x {gpu}", "spec": "llama3-8b.yaml",
            "set": ["train.grad_accum_steps=8", "train.activation_checkpointing=selective-2", "train.compile=blocks",
                    *sets],
            "accelerator": accelerator, "strategy": "fsdp", "gpus": 8, "counter": "reserved",
            "published_bytes": int(gib * GiB), "source": f"{TORCHAO} \"Training benchmarks\", {gpu} table"}


def _peft(offload: str, gb: float) -> dict:
    """huggingface/peft's FSDP guide, "Memory usage" of its QLoRA + FSDP section: Llama-2-70B QLoRA over 2 GPUs, FSDP1
    with ``fsdp_offload_params: true`` (19.6 GB per GPU) and without it (35.6 GB). The page names no counter
    (allocated, reserved or nvidia-smi) and no GB/GiB: the row is compared with all three of pilotrun's figures and
    counted toward no goal."""
    return {"job": f"Llama-2-70B QLoRA, FSDP1 offload {offload}, 2 GPUs", "spec": "llama2-70b-qlora-fsdp-offload.yaml",
            "set": [f"distributed.offload={offload}"], "accelerator": "RTX4090-24GB", "strategy": "fsdp", "gpus": 2,
            "counter": "unknown", "published_bytes": int(gb * 1e9),
            "source": f"{PEFT} (section \"Use PEFT QLoRA and FSDP ...\", \"Memory usage\")"}


RUNS = [
    _fms("Mistral-7B LoRA, fp16 weights", "mistral-7b-lora.yaml", 4, 12, 26108963328, 15119590912),
    _fms("Mistral-7B LoRA, fp16 weights", "mistral-7b-lora.yaml", 8, 14, 37098695168, 15119984128),
    _fms("Mistral-7B QLoRA nf4, fp16 AMP", "mistral-7b-qlora.yaml", 4, 24, 22825932800, 5368221184),
    _fms("Mistral-7B QLoRA nf4, fp16 AMP", "mistral-7b-qlora.yaml", 8, 26, 40278956032, 5368614400),
    _fms("Mistral-7B full, bf16 weights", "mistral-7b-full.yaml", 4, 0, 72971724288, 44004763136),
    _fms("Mistral-7B full, bf16 weights", "mistral-7b-full.yaml", 8, 2, 72972117504, 44005156352),
    # The plugin's preparation (no fp32 upcast), one GPU: Mistral-7B and Llama-2-70B.
    _fms("Mistral-7B QLoRA nf4, plugin prep", "mistral-7b-qlora.yaml", 4, 36, 15860019712, 4843384320, also=PREP),
    _fms("Mistral-7B QLoRA nf4, plugin prep", "mistral-7b-qlora.yaml", 8, 38, 26849751552, 4843777536, also=PREP),
    _fms("Llama-2-70B QLoRA nf4, plugin prep", "llama2-70b-qlora-fms.yaml", 4, 44, 68159977472, 37346815488),
    # The same jobs over 2 GPUs with FSDP1, per-device batch halved (TRL skips its preparation for a base loaded
    # on the CPU for FSDP, so both QLoRA scenarios ran without the upcast: the CSV's rows 25/37 and 27/39 agree).
    _fms("Mistral-7B LoRA, fp16 weights", "mistral-7b-lora.yaml", 2, 13, 15123161088, 7850391552, gpus=2),
    _fms("Mistral-7B LoRA, fp16 weights", "mistral-7b-lora.yaml", 4, 15, 21433753600, 7850588160, gpus=2),
    _fms("Mistral-7B full, bf16 weights", "mistral-7b-full.yaml", 2, 1, 36762859520, 29521119232, gpus=2),
    _fms("Mistral-7B full, bf16 weights", "mistral-7b-full.yaml", 4, 3, 36763056128, 29521315840, gpus=2),
    _fms("Mistral-7B QLoRA nf4, plugin prep", "mistral-7b-qlora.yaml", 2, 37, 9974622720, 2727018496, gpus=2,
         also=PREP),
    _fms("Mistral-7B QLoRA nf4, plugin prep", "mistral-7b-qlora.yaml", 4, 39, 16587205120, 2727215104, gpus=2,
         also=PREP),
    _fms("Llama-2-70B QLoRA nf4, plugin prep", "llama2-70b-qlora-fms.yaml", 2, 45, 46524471808, 19172741120, gpus=2),
    _fms("Mixtral-8x7B LoRA, fp16 weights", "mixtral-8x7b-lora-fms.yaml", 2, 17, 57540387840, 47311452160, gpus=2),
    _fms("Mixtral-8x7B LoRA, fp16 weights", "mixtral-8x7b-lora-fms.yaml", 4, 19, 64347637760, 47311648768, gpus=2),
    _titan(8, 82.4, "Table 1"),
    _titan(128, 67.0, "Table 3"),
    _peft("cpu", 19.6),
    _peft("none", 35.6),
    _torchao("H100-80GB", "bf16", 47.65),
    _torchao("H100-80GB", "tensorwise", 47.77),
    _torchao("H100-80GB", "rowwise", 47.79),
    _torchao("MI300X-192GB", "bf16", 39.09),
    _torchao("MI300X-192GB", "tensorwise", 39.07),
    _torchao("MI300X-192GB", "rowwise", 39.32),
]
def _no_result(job: str, spec: str, sets: list[str], row: int, mib: float, gpus: int = 1) -> dict:
    """An fms-acceleration CSV row with no result (no peak, loss or time) while ``mib`` MiB of an 80 GB GPU were in
    use (its nvidia_mem_reserved). The CSV records no error, so "out of memory" is inferred, not published: the
    estimate is set beside it (does it fit?) and counted toward no goal. Over 2 GPUs the run is FSDP1, as in _fms."""
    return {"job": job + (f", FSDP1 {gpus}x A100" if gpus > 1 else ""), "spec": spec, "set": sets,
            "accelerator": "A100-80GB", "strategy": "fsdp" if gpus > 1 else "single", "gpus": gpus,
            "nvidia_mem_reserved_mib": mib, "source": f"{FMS} row {row}"}


# Every run the CSV left without a result whose job a spec here describes (the full fine-tunes of Mixtral and
# Llama-2-70B, and 70B LoRA over fp16 weights, have none).
NO_RESULT = [
    _no_result("Llama-2-70B QLoRA nf4, plugin prep, batch 8", "llama2-70b-qlora-fms.yaml",
               ["train.micro_batch_size=8"], 46, 80405.0),
    _no_result("Llama-2-70B QLoRA nf4, TRL prep (fp32 upcast), batch 4", "llama2-70b-qlora-fms.yaml",
               ["train.micro_batch_size=4", "model.quantization.prepare=peft"], 32, 80893.0),
    _no_result("Llama-2-70B QLoRA nf4, TRL prep (fp32 upcast), batch 8", "llama2-70b-qlora-fms.yaml",
               ["train.micro_batch_size=8", "model.quantization.prepare=peft"], 34, 79557.0),
    _no_result("Llama-2-70B QLoRA nf4, plugin prep, batch 4", "llama2-70b-qlora-fms.yaml",
               ["train.micro_batch_size=4"], 47, 80954.0, gpus=2),
    _no_result("Llama-2-70B QLoRA nf4, baseline (TRL skips its prep under FSDP), batch 4", "llama2-70b-qlora-fms.yaml",
               ["train.micro_batch_size=4"], 35, 80749.0, gpus=2),
    _no_result("Mixtral-8x7B LoRA, fp16 weights, batch 4", "mixtral-8x7b-lora-fms.yaml",
               ["train.micro_batch_size=4"], 16, 80955.0),
    _no_result("Mixtral-8x7B LoRA, fp16 weights, batch 8", "mixtral-8x7b-lora-fms.yaml",
               ["train.micro_batch_size=8"], 18, 80955.0),
]

# The figures a row whose counter is unknown is set beside: the estimate's allocated, reserved and device-used peaks.
FIGURES = {"allocated": "peak_allocated_bytes", "reserved": "peak_reserved_bytes", "device": "device_used_bytes"}


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


def compare(run: dict) -> dict:
    """One row: the estimate's figure for the row's counter against the published one (every figure where the
    source names no counter: then ``ratio`` is None and the row counts toward no goal)."""
    est = estimate(run)
    fit = est["fits"][0]
    if run["counter"] == "unknown":
        mine = {c: fit[k] for c, k in FIGURES.items()}
        row = {**run, "spec": f"bench/published/{run['spec']}", "estimated_bytes": mine, "ratio": None,
               "ratios": {c: round(v / run["published_bytes"], 4) for c, v in mine.items()},
               "limiting_stage": fit.get("limiting_stage")}
        if fit.get("host_bytes_per_node"):
            row["estimated_host_bytes_per_node"] = fit["host_bytes_per_node"]
        return row
    # The row's own counter: torch.cuda.max_memory_allocated or max_memory_reserved, as the source recorded it.
    mine = fit["peak_allocated_bytes"] if run["counter"] == "allocated" else fit["peak_reserved_bytes"]
    row = {**run, "spec": f"bench/published/{run['spec']}", "estimated_bytes": mine,
           "ratio": round(mine / run["published_bytes"], 4), "limiting_stage": fit.get("limiting_stage")}
    if run.get("published_stack"):
        # Set beside the ratio, never in it: the estimate's figure plus what the published stack is known to have held.
        spec = yaml.safe_load((SPECS / run["spec"]).read_text())
        held = rotary_cache_bytes(spec["model"]["config"])
        row.update(published_stack_bytes=held,
                   ratio_with_published_stack=round((mine + held) / run["published_bytes"], 4))
    if "published_state_bytes" in run:
        # What stays allocated after training: parameters and optimizer state (the Trainer frees gradients with
        # set_to_none; counting them read 1.32x on the full fine-tune, whose gradients are 14.5 GB).
        # Over FSDP each GPU keeps its shard: the whole divided by the GPUs, but for a quantised base's absmax and
        # codes, which every rank keeps whole.
        m = est["model"]
        whole = (est.get("adapter") or {}).get("quant_state_bytes") or 0
        state = (m["parameter_bytes"] - whole + m["optimizer_state_bytes"]) // run["gpus"] + whole
        row.update(estimated_state_bytes=state, state_ratio=round(state / run["published_state_bytes"], 4))
        if row.get("published_stack_bytes"):
            row["state_ratio_with_published_stack"] = round(
                (state + row["published_stack_bytes"]) / run["published_state_bytes"], 4)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help="run only the rows whose job name contains this text")
    ap.add_argument("--tag", default="", help="results file published_memory-TAG-<device>-<date>.json")
    args = ap.parse_args()
    runs = [r for r in RUNS if args.only in r["job"]]
    failed = [r for r in NO_RESULT if args.only in r["job"]]
    if not runs and not failed:
        raise SystemExit(f"--only {args.only!r}: no row's job contains it; the jobs are: "
                         + "; ".join(sorted({r['job'] for r in RUNS + NO_RESULT})))
    rows = []
    print(f"{'job':44} {'set':>28} {'counter':>9} {'published':>10} {'estimate':>9} {'ratio':>6}")
    for run in runs:
        row = compare(run)
        rows.append(row)
        figures = row["estimated_bytes"] if isinstance(row["estimated_bytes"], dict) else {run["counter"]:
                                                                                           row["estimated_bytes"]}
        for counter, mine in figures.items():
            stack = (f"  ({row['ratio_with_published_stack']:.3f} with the published stack's "
                     f"{row['published_stack_bytes'] / GiB:.2f} GiB)" if row.get("published_stack_bytes") else "")
            print(f"{run['job']:44} {' '.join(s.split('=')[-1] for s in run['set']):>28} {counter:>9} "
                  f"{run['published_bytes'] / GiB:>6.2f} GiB {mine / GiB:>5.2f} GiB "
                  f"{mine / run['published_bytes']:>6.3f}{stack}")
    counted = [r for r in rows if r["ratio"] is not None]
    within = sum(abs(r["ratio"] - 1) <= 0.10 for r in counted)
    print(f"\n{within} of {len(counted)} within ±10% of the published counter"
          + (f" ({len(rows) - len(counted)} rows with no named counter not counted)" if len(counted) < len(rows)
             else ""))
    stacked = [r for r in counted if "ratio_with_published_stack" in r]
    if stacked:
        print(f"{sum(abs(r['ratio_with_published_stack'] - 1) <= 0.10 for r in stacked)} of {len(stacked)} rows that "
              "name their published stack within ±10% with what it held added (not counted above); within ±5%: "
              f"{sum(abs(r['ratio_with_published_stack'] - 1) <= 0.05 for r in stacked)} with it, "
              f"{sum(abs(r['ratio'] - 1) <= 0.05 for r in stacked)} without")
    unfit = []
    for run in failed:
        # Compared, never counted: whatever the estimate says is printed, fit or not.
        fit = estimate(run)["fits"][0]
        unfit.append({**run, "spec": f"bench/published/{run['spec']}", "estimate_fits": fit["fits"],
                      "estimated_allocated_bytes": fit["peak_allocated_bytes"],
                      "estimated_device_bytes": fit["device_used_bytes"], "capacity_bytes": fit["capacity_bytes"]})
        print(f"no result at {run['nvidia_mem_reserved_mib']:.0f} MiB in use: {run['job']:58} the estimate: "
              f"{fit['device_used_bytes'] / GiB:6.1f} GiB of {fit['capacity_bytes'] / GiB:.1f}, "
              f"{'fits' if fit['fits'] else 'does not fit'}")
    if unfit:
        print(f"{sum(not r['estimate_fits'] for r in unfit)} of {len(unfit)} runs that left no result: the estimate "
              "says they do not fit")
    write_results("published_memory" + (f"-{args.tag}" if args.tag else ""),
                  {"sources": [FMS, TITAN, PEFT, TORCHAO], "assumed": "fms rows: every sequence 4096 tokens",
                   "only": args.only or None, "within_10_percent": within, "counted_rows": len(counted),
                   "machine": machine(), "rows": rows, "no_result_rows": unfit})


if __name__ == "__main__":
    main()
